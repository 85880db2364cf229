"""Split the GPU tests that memcheck has still to pass into groups, one memcheck pass each.

``device_suite.sh memcheck-resume`` with ``MEMCHECK_GROUPS=auto`` runs this on the output of
``pytest --collect-only -q`` (with the ledger filter, so only tests still to pass are listed)
and runs one pass per group, with fresh worker processes each. Why groups: memcheck keeps the
memory of every array that was live in a Python frame at a CUDA call, so a worker that runs a
whole suite grows until the card is full (2026-12-06, H100: one worker reached 47.7 GB; see
``docs/bench_logs/session23_2026-12-06``).

Usage: ``python benchmarks/memcheck_groups.py COLLECTED.txt [TESTS_PER_GROUP]`` prints the
groups as ``"a.py b.py::test_f;c.py"`` (space-separated node ids, groups separated by ``;``),
nothing when no test is left; exit status 1 (the errors on stderr) when the collection
reported errors, since the tests of a file that failed to import are missing from it.

Whole files are packed into groups of at most TESTS_PER_GROUP tests (default 150), largest
first; a file with more tests than that is split by test function. The subprocess tests
(``test_examples.py``, ``test_dask.py``) form the last group: each takes minutes under the
sanitizer, and the short tests should not wait behind them.
"""
import collections
import sys

#: files whose GPU tests start subprocesses or clusters: run last, in a group of their own
LAST = ("tests/test_examples.py", "tests/test_dask.py")


def read_node_ids(lines):
    """Node ids (``path.py::name[params]``) from ``pytest --collect-only -q`` output; other
    lines with ``::`` (stderr is merged in: "std::bad_alloc", "c10::Error") are not tests."""
    ids = []
    for line in lines:
        if "::" not in line or line[:1].isspace():
            continue
        path = line.partition("::")[0]
        if path.endswith(".py") and not any(c.isspace() for c in path):
            ids.append(line.strip())
    return ids


def collection_errors(lines):
    """The short summary's ``ERROR <file>`` lines (or the "Interrupted: ... during collection"
    line): the tests of a file that failed to import are missing from the node ids."""
    errors = [line.rstrip() for line in lines if line.startswith("ERROR ")]
    if not errors:
        errors = [line.strip("! \n") for line in lines if "during collection" in line]
    return errors


def plan_groups(node_ids, per_group=150):
    """Groups of node-id selectors (files, or ``file::function`` for large files)."""
    per_file = collections.OrderedDict()
    for nid in node_ids:
        path, _, rest = nid.partition("::")
        func = rest.split("[", 1)[0]
        per_file.setdefault(path, collections.Counter())[func] += 1
    units, last = [], []
    for path, funcs in per_file.items():
        total = sum(funcs.values())
        target = last if path in LAST else units
        if total <= per_group or path in LAST:
            target.append((path, total))
        else:
            target.extend((f"{path}::{f}", n) for f, n in funcs.items())
    groups, sizes = [], []
    for unit, n in sorted(units, key=lambda u: -u[1]):  # first fit, largest first
        for i, size in enumerate(sizes):
            if size + n <= per_group:
                groups[i].append(unit)
                sizes[i] += n
                break
        else:
            groups.append([unit])
            sizes.append(n)
    if last:
        groups.append([u for u, _ in last])
    return [" ".join(g) for g in groups]


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    with open(argv[1], errors="replace") as f:
        lines = f.readlines()
    errors = collection_errors(lines)
    if errors:
        # no plan: a group list without the failed files would read as "nothing left to run"
        print("pytest could not collect every test:\n" + "\n".join(errors), file=sys.stderr)
        return 1
    ids = read_node_ids(lines)
    per_group = int(argv[2]) if len(argv) > 2 else 150
    print(";".join(plan_groups(ids, per_group)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
