"""The documentation: README commands, site structure, API coverage, runnable quick start.

``mkdocs build --strict`` itself runs in ``.ci/run``; these tests check what
a strict build cannot: that every public name is documented, that the README
opens with the two set-up commands, and that the quick start's code runs.
"""
import importlib
import re
from pathlib import Path

import numpy as np
import pytest

from twellpy._array import gpu_available

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

#: Modules whose every public name (``__all__``) must be in the API reference,
#: with the framework each needs.
API_MODULES = {
    "twellpy.io": None, "twellpy.ops": None, "twellpy.ffn": None, "twellpy.stats": None,
    "twellpy.plot": "matplotlib", "twellpy.torch": "torch", "twellpy.jax": "jax", "twellpy.dask": "dask",
}


def _fenced_blocks(text, lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _nav_files(nav):
    for item in nav:
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for v in item.values():
                yield from ([v] if isinstance(v, str) else _nav_files(v))


def _mkdocs_config():
    yaml = pytest.importorskip("yaml")  # PyYAML comes with mkdocs (the docs extra)

    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml may use !!python/name tags for extensions; none are needed here.
    return yaml.load((REPO / "mkdocs.yml").read_text(), Loader=Loader)


def _api_directives():
    found = set()
    for page in (DOCS / "api").glob("*.md"):
        found.update(re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M))
    return found


# ---------------------------------------------------------------------- README
def test_readme_opens_with_the_two_setup_commands():
    text = (REPO / "README.md").read_text()
    blocks = _fenced_blocks(text, "bash")
    assert [b.strip() for b in blocks[:2]] == [
        'pip install -e ".[cuda]" && python -m twellpy demo',
        'pip install -e ".[test]" && pytest',
    ]
    # nothing but the title comes before them
    before = text[: text.index("```bash")]
    assert [ln for ln in before.splitlines() if ln.strip()] == ["# twellpy"]


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && pytest' in ci
    assert "tools/check_kernels.py" in ci and "mkdocs build --strict" in ci


# ------------------------------------------------------------------ site layout
def test_every_nav_page_and_image_exists():
    cfg = _mkdocs_config()
    assert cfg["strict"] is True
    pages = list(_nav_files(cfg["nav"]))
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, f"pages in mkdocs.yml nav but not in docs/: {missing}"
    for page in pages:
        for img in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", (DOCS / page).read_text()):
            assert (DOCS / page).parent.joinpath(img).resolve().is_file(), f"{page}: missing image {img}"


def test_required_pages_are_in_the_nav():
    pages = set(_nav_files(_mkdocs_config()["nav"]))
    for required in ("quickstart.md", "formats.md", "choosing.md", "interop.md", "dask.md",
                     "benchmarks.md", "api/index.md", "cli.md", "examples.md"):
        assert required in pages, required


def test_format_pictures_are_png_files():
    for name in ("ell", "twell", "hybrid", "slots_overflow", "hybrid_width"):
        data = (DOCS / "images" / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000, name
    text = (DOCS / "formats.md").read_text()
    for name in ("ell", "twell", "hybrid"):
        assert f"(images/{name}.png)" in text


def test_mkdocstrings_uses_numpy_style():
    cfg = _mkdocs_config()
    plugins = {next(iter(p)) if isinstance(p, dict) else p: p for p in cfg["plugins"]}
    opts = plugins["mkdocstrings"]["mkdocstrings"]["handlers"]["python"]["options"]
    assert opts["docstring_style"] == "numpy"


# --------------------------------------------------------------- API coverage
def test_top_level_names_are_in_the_api_reference():
    import twellpy

    directives = _api_directives()
    for name in twellpy.__all__:
        if name == "__version__":
            continue
        if name in ("save", "load"):
            assert "twellpy.io" in directives
        elif f"twellpy.{name}" in API_MODULES:
            assert f"twellpy.{name}" in directives, name
        else:
            assert f"twellpy.{name}" in directives, f"twellpy.{name} has no ::: entry in docs/api/"
            assert (getattr(twellpy, name).__doc__ or "").strip(), f"twellpy.{name} has no docstring"


@pytest.mark.parametrize("modname", sorted(API_MODULES))
def test_module_public_names_are_documented(modname):
    if API_MODULES[modname]:
        pytest.importorskip(API_MODULES[modname])
    mod = importlib.import_module(modname)
    assert modname in _api_directives(), f"no '::: {modname}' in docs/api/"
    assert (mod.__doc__ or "").strip(), f"{modname} has no module docstring"
    public = getattr(mod, "__all__", None)
    if public is None:  # twellpy.io: its public functions
        public = [n for n, v in vars(mod).items()
                  if not n.startswith("_") and callable(v) and getattr(v, "__module__", "") == modname]
    assert public, modname
    # mkdocstrings hides members without a docstring (show_if_no_docstring: false)
    undocumented = [n for n in public
                    if not isinstance(getattr(mod, n), (int, float, str))
                    and not (getattr(mod, n).__doc__ or "").strip()]
    assert not undocumented, f"{modname}: no docstring for {undocumented}"


def test_container_methods_have_docstrings():
    import twellpy as tw

    for cls in (tw.ELL, tw.TwELL, tw.Hybrid, tw.SparseArray):
        assert (cls.__doc__ or "").strip(), cls
    for name in ("from_dense", "from_scipy", "from_components", "toarray", "to_scipy", "asformat",
                 "astype", "copy", "transpose", "to_device", "check_format", "components"):
        for cls in (tw.ELL, tw.TwELL, tw.Hybrid):
            assert (getattr(cls, name).__doc__ or "").strip(), f"{cls.__name__}.{name}"


# ------------------------------------------------------------ runnable quick start
def test_quickstart_code_runs(tmp_path, monkeypatch):
    """Every Python block of the quick start runs in order (GPU blocks on a GPU only)."""
    monkeypatch.chdir(tmp_path)
    text = (DOCS / "quickstart.md").read_text()
    blocks = _fenced_blocks(text, "python")
    assert len(blocks) >= 4
    ns = {}
    ran = 0
    for code in blocks:
        if "cupy" in code and not gpu_available():
            continue
        exec(compile(code, "quickstart.md", "exec"), ns)
        ran += 1
    assert ran >= 4
    assert np.array_equal(ns["A2"].toarray(), ns["h"])


def test_readme_tour_names_exist():
    """The README's tour only uses names that exist."""
    import twellpy as tw
    import twellpy.ffn

    text = (REPO / "README.md").read_text()
    for dotted in set(re.findall(r"\btw\.([A-Za-z_][\w.]*)\(", text)):
        obj = tw
        for part in dotted.split("."):
            obj = getattr(obj, part)
        assert callable(obj), dotted
    assert hasattr(twellpy.ffn, "gated_backward")


def _python_blocks(page):
    return _fenced_blocks((REPO / page).read_text(), "python")


def test_readme_tour_runs(tmp_path, monkeypatch):
    """The README's tour is one self-contained block that runs as written."""
    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks("README.md")
    assert len(blocks) == 1
    ns = {}
    exec(compile(blocks[0], "README.md", "exec"), ns)
    assert np.array_equal(ns["A2"].toarray(), ns["h"])
    x, w_gate, w_up, w_down = ns["x"], ns["w_gate"], ns["w_up"], ns["w_down"]
    ref = (np.maximum(x @ w_gate.T, 0) * (x @ w_up.T)) @ w_down.T
    assert np.allclose(ns["tw"].ffn.gated_forward(x, w_gate, w_up, w_down), ref, rtol=1e-4, atol=1e-5)
    assert ns["dw_down"].shape == w_down.shape and ns["dx"].shape == x.shape
    # the comment promises a sparse activation: a few percent of the neurons
    assert 0 < ns["ctx"].stats["l0"] < 0.1 * w_gate.shape[0]


def test_choosing_snippet_runs():
    """docs/choosing.md measures slots on the reader's ``acts``: run it on synthetic ones."""
    (code,) = _python_blocks("docs/choosing.md")
    acts = np.maximum(np.random.default_rng(0).standard_normal((512, 1000), dtype=np.float32) - 2.0, 0)
    ns = {"acts": acts}
    exec(compile(code, "choosing.md", "exec"), ns)
    assert ns["occ"].shape == (512, 4)
    assert isinstance(ns["slots"], (int, np.integer)) and 1 <= ns["slots"] <= 256


def test_interop_torch_snippets_run():
    """The PyTorch blocks of docs/interop.md, then the components block, run as written."""
    torch = pytest.importorskip("torch")
    blocks = [b for b in _python_blocks("docs/interop.md") if "cupy" not in b and "jax" not in b]
    assert len(blocks) == 3, "interop.md: expected two PyTorch blocks and the components block"
    ns = {}
    for code in blocks:
        exec(compile(code, "interop.md", "exec"), ns)
    assert isinstance(ns["y"], torch.Tensor) and ns["mlp"].down_proj.weight.grad is not None
    assert np.array_equal(ns["A2"].toarray(), ns["A"].toarray())


def test_interop_jax_snippet_runs():
    jax = pytest.importorskip("jax")
    (code,) = [b for b in _python_blocks("docs/interop.md") if "import jax" in b]
    ns = {}
    exec(compile(code, "interop.md", "exec"), ns)
    grads = ns["grads"]
    assert [g.shape for g in grads] == [(256, 128), (512, 128), (512, 128), (128, 512)]
    assert all(bool(jax.numpy.isfinite(g).all()) for g in grads)


def test_links_outside_the_site_resolve():
    """README.md and examples/ are not built by mkdocs (whose strict mode checks the
    links inside docs/): their links, and the Markdown files the example scripts
    name, must exist in the repository."""
    missing = []
    for page in ("README.md", "examples/README.md"):
        for target in re.findall(r"\]\(([^)#\s]+)", (REPO / page).read_text()):
            if "://" not in target and not (REPO / page).parent.joinpath(target).exists():
                missing.append(f"{page}: {target}")
    for script in sorted((REPO / "examples").glob("*.py")):
        for name in set(re.findall(r"[\w./-]+\.md\b", script.read_text())):
            if not any((REPO / base / name).exists() for base in ("", "docs", "examples")):
                missing.append(f"examples/{script.name}: {name}")
    assert not missing, missing


def test_examples_use_only_the_public_api():
    """Examples are what users copy: a private import there becomes user code that breaks."""
    import re

    private = []
    for path in sorted((REPO / "examples").glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\btwellpy\.(_\w+|backends)\b", line):
                private.append(f"{path.name}:{n}: {line.strip()}")
    assert not private, "examples import private twellpy modules:\n" + "\n".join(private)
