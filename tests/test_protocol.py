"""The committed protocol code is what the pinned generator makes; the converters round-trip."""

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autobyte.convert import config_from_proto, config_to_proto, metrics_from_proto, metrics_to_proto
from autobyte.types import MAX_CREDIT_BYTES, MAX_PARTITION_BYTES, MIN_CREDIT_BYTES, MIN_PARTITION_BYTES
from autobyte.types import Config, StepMetrics
from tests.helpers.paths import ROOT


def test_generated_code_is_fresh():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stale_check_detects_an_edit(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = tmp_path / "autobyte" / "protocol"
    committed.mkdir(parents=True)
    for path in (ROOT / "client" / "autobyte" / "protocol").glob("*_pb2*"):
        (committed / path.name).write_text(path.read_text())
    monkeypatch.setattr(gen, "SOURCE_ROOT", tmp_path)
    assert gen.main(["--check"]) == 0
    stale = committed / "autobyte_pb2.py"
    stale.write_text(stale.read_text() + "\n# hand edit\n")
    assert gen.main(["--check"]) == 1


configs = st.builds(Config, st.one_of(st.none(), st.integers(MIN_PARTITION_BYTES, MAX_PARTITION_BYTES)),
                    st.one_of(st.none(), st.integers(MIN_CREDIT_BYTES, MAX_CREDIT_BYTES)))
floats = st.floats(0, 1e6, allow_nan=False)


@given(configs)
def test_config_round_trip(config):
    assert config_from_proto(config_to_proto(config)) == config


@given(st.integers(1, 2**40), st.builds(StepMetrics, step=st.integers(0, 2**40), wall_time_s=floats,
                                        step_time_s=floats, exposed_comm_s=floats, bytes_reduced=st.integers(0, 2**50),
                                        partitions=st.integers(0, 2**30), config=configs,
                                        decision_id=st.integers(0, 2**40), host_load=st.floats(0, 1)))
def test_metrics_round_trip(seq, metrics):
    assert metrics_from_proto(metrics_to_proto(metrics, seq)) == (seq, metrics)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4MiB", True, 1 << 40, MIN_PARTITION_BYTES - 1])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="partition_bytes"):
        Config(partition_bytes=bad)
