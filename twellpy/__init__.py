"""twellpy: activation-sparse computation with TwELL, ELL and Hybrid formats."""
__version__ = "0.1.0"
