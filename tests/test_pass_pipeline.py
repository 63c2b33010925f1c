"""The pass pipeline is written once, in gradsched/sync/pass_pipeline.py: the docs' table is it, every pass
runs through it, in its order, and nothing else calls a pass."""
import os
import re

import pytest
import torch
import torch.fx as fx

from gradsched.sync import pass_pipeline
from gradsched.sync.pass_pipeline import PIPELINE, Conditions, Later, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def design_table() -> list[tuple[str, ...]]:
    text = open(os.path.join(ROOT, "docs", "design.md")).read()
    section = text.split("### The pass pipeline and its invariants", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| #")]
    return [tuple(c.strip() for c in r.strip("|").split("|"))[:5] for r in rows if r.split("|")[1].strip().isdigit()]


def test_the_design_docs_table_is_the_pass_list_in_code():
    assert design_table() == pass_pipeline.table()


def test_every_pass_names_a_known_graph_and_the_graphs_come_in_the_order_of_a_graphs_life():
    order = list(pass_pipeline.GRAPHS)
    positions = [order.index(p.graph) for p in PIPELINE]
    assert positions == sorted(positions)


def test_every_pass_module_exists_and_states_its_invariant():
    for p in PIPELINE:
        path = os.path.join(ROOT, p.module)
        head = open(path).read().split('"""')[1]
        assert os.path.exists(path) and re.search(r"Invariant|invariant", head), p.module


def test_no_module_outside_the_pipeline_calls_a_pass_itself():
    """A pass called directly would run out of the list's order, unseen by GRADSCHED_PRINT_GRAPHS."""
    names = {p.name for p in PIPELINE}
    call = re.compile(r"(?<![\w.])(" + "|".join(sorted(names)) + r")\(")
    found = []
    for top in ("gradsched", "benchmarks"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(dirpath, f)
                if not f.endswith(".py") or path.endswith(os.path.join("sync", "pass_pipeline.py")):
                    continue
                for i, line in enumerate(open(path), 1):
                    if call.search(line) and not line.lstrip().startswith(("def ", "#")):
                        found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not found, found


def small_graph() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(torch.ops.aten.mul.Tensor, (x, x)),))
    return fx.GraphModule(torch.nn.Module(), g)


def test_run_applies_a_graphs_passes_in_the_lists_order_and_only_those_that_apply():
    seen = []
    fake = tuple(pass_pipeline.Pass(f"p{i}", "sync", "always", lambda c, i=i: i != 1,
                                    lambda gm, spec, i=i: (gm, seen.append((i, spec)) or i)) for i in range(3))
    original = pass_pipeline.PIPELINE
    pass_pipeline.PIPELINE = fake
    try:
        records = run("sync", small_graph(), Conditions(), {"p0": "a", "p1": "b", "p2": Later(lambda r: r["p0"] + 10)})
    finally:
        pass_pipeline.PIPELINE = original
    assert seen == [(0, "a"), (2, 10)] and list(records) == ["p0", "p2"]


def test_a_pass_that_applies_without_a_spec_is_refused_by_name():
    with pytest.raises(KeyError, match="insert_grad_sync applies to the sync graph"):
        run("sync", small_graph(), Conditions(), {"sink_waits": None})


def test_print_graphs_names_each_rewrite_by_pass(monkeypatch, capsys):
    monkeypatch.setenv("GRADSCHED_PRINT_GRAPHS", "1")
    run("compiled", small_graph(), Conditions(where="early0"), {"defer_waits": None}, what="an early graph")
    out = capsys.readouterr().out
    assert "an early graph, before its passes" in out and "an early graph, after defer_waits" in out
