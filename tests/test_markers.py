"""The markers a test gets from what its code reaches (tests/helpers/kinds.py), for each kind."""

from __future__ import annotations

import subprocess

from tests.helpers.databases import DATABASES
from tests.helpers.dist import run_ranks
from tests.helpers.kinds import Reach, kinds_of_test


def _pure(x):
    return sorted(x)


def _starts_a_process():
    return subprocess.run(["true"], check=False)


def _through_a_local_helper():
    return _starts_a_process()


def _spawns_ranks():
    return run_ranks(_pure, 2)


def _spawns_ranks_too():
    return run_ranks(_pure, 2)


def _in_a_lambda():
    return lambda: subprocess.run(["true"], check=False)


def _imports_the_testbed_inside():
    from benchmarks.testbed import Testbed

    return Testbed


def _imports_only_pure_testbed_parts():
    from benchmarks.testbed import parse_rate

    return parse_rate("1gbit")


def _imports_torch_multiprocessing():
    import torch.multiprocessing as mp

    return mp


# Reached through a dict, which the walk does not enter: these tests themselves stay unmarked.
SAMPLE = {
    function.__name__.lstrip("_"): function
    for function in (
        _pure,
        _starts_a_process,
        _through_a_local_helper,
        _spawns_ranks,
        _spawns_ranks_too,
        _in_a_lambda,
        _imports_the_testbed_inside,
        _imports_only_pure_testbed_parts,
        _imports_torch_multiprocessing,
    )
}


def test_each_kind_is_found_where_the_code_reaches_it():
    reach = Reach()
    assert reach.kinds_of(SAMPLE["pure"]) == frozenset()
    assert reach.kinds_of(SAMPLE["starts_a_process"]) == {"multiprocess"}
    assert reach.kinds_of(SAMPLE["through_a_local_helper"]) == {"multiprocess"}
    assert reach.kinds_of(SAMPLE["spawns_ranks"]) == {"multiprocess"}
    assert reach.kinds_of(SAMPLE["spawns_ranks_too"]) == {"multiprocess"}  # run_ranks seen before
    assert reach.kinds_of(SAMPLE["in_a_lambda"]) == {"multiprocess"}
    assert reach.kinds_of(SAMPLE["imports_the_testbed_inside"]) == {"netns"}
    assert reach.kinds_of(SAMPLE["imports_only_pure_testbed_parts"]) == frozenset()
    assert reach.kinds_of(SAMPLE["imports_torch_multiprocessing"]) == {"multiprocess"}


def test_fixtures_count_by_their_code_and_by_name():
    reach = Reach()
    in_fixture = kinds_of_test(reach, SAMPLE["pure"], [SAMPLE["starts_a_process"]], [])
    assert in_fixture == {"multiprocess"}
    assert kinds_of_test(reach, SAMPLE["pure"], [], ["tmp_path", "pg_url"]) == {"postgres"}
    assert kinds_of_test(reach, SAMPLE["pure"], [], ["tmp_path", "db_url"]) == frozenset()


def test_this_test_is_in_the_fast_subset_and_postgresql_cases_are_not(request):
    assert request.node.get_closest_marker("slow") is None
    assert request.node.get_closest_marker("multiprocess") is None
    (postgresql,) = [case for case in DATABASES if getattr(case, "values", None) == ("postgresql",)]
    assert "postgres" in {mark.name for mark in postgresql.marks}
