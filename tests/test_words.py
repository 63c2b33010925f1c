"""One meaning per word (docs/design.md, "One meaning per word"): the retired spellings stay out of the code."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = [p for top in ("gradsched", "passes", "benchmarks", "examples") for p in (ROOT / top).rglob("*.py")]

# retired spelling -> what it is called now
RETIRED = {
    r"split_backward|SPLIT_BACKWARD|SplitSpec|SplitRecord|SplitFns": "cut_backward, CutSpec, CutRecord, Halves (a backward cut in B and W)",
    r"placement\s*==\s*[\"']split[\"']|placement=[\"']split[\"']": "placement='tied_at_flush'",
    r"stage_placement|placement_style": "stage_assignment, assignment_style (which stages a rank holds)",
    r"^\s*params_sharded\s*:|params_sharded=": "SyncPlan.shard == 'params' (params_sharded is derived, never carried)",
}


def test_no_source_uses_a_retired_spelling():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()} (now: {now})"
             for p in SOURCES for i, line in enumerate(p.read_text().splitlines(), 1)
             for pattern, now in RETIRED.items() if re.search(pattern, line)]
    assert not found, found


def test_no_two_modules_of_the_package_share_a_file_name():
    names = {}
    for p in [p for top in ("gradsched", "passes") for p in (ROOT / top).rglob("*.py")]:
        if p.name != "__init__.py":
            names.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert {n: ps for n, ps in names.items() if len(ps) > 1} == {}
