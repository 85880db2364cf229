"""Sparse feed-forward layers: fused inference and the training step.

Inference (``gated_forward``, ``relu_forward``, ``GatedFFN``, ``ReluFFN``) lives
in :mod:`twellpy._ffn_infer`; training (``gated_forward_train``,
``gated_backward``, ``relu_forward_train``, ``relu_backward``) in
:mod:`twellpy._ffn_train`. This module is the public face of both.
"""
from ._ffn_infer import *  # noqa: F401,F403
from ._ffn_infer import __all__ as _infer_all
from ._ffn_train import *  # noqa: F401,F403
from ._ffn_train import __all__ as _train_all

__all__ = list(_infer_all) + list(_train_all)
