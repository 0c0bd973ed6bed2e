"""Jobs that save and exit exit 0: the writer thread and the gloo group that checkpoints make
are stopped at exit, and two jobs racing to save to one path end with one checkpoint and one
clear refusal, never an abort."""

import os
import subprocess
import sys

import pytest

from autoshard import checkpoint
from local_ranks import free_port, rank_env

SUPPORT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
SCRIPT = os.path.join(SUPPORT_DIR, "save_and_exit_worker.py")


def _start_job(directory, how: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    port = free_port()
    return [subprocess.Popen([sys.executable, SCRIPT, str(directory), how],
                             env={**env, **rank_env(port, r, 2), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]


def _finish(procs) -> list:
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), outputs
    assert not any("terminate called" in out or "autoshard: the asynchronous save" in out for out in outputs), outputs
    return outputs


@pytest.mark.parametrize("how", ["wait", "destroy", "in_flight"])
def test_a_job_whose_save_committed_exits_0(tmp_path, how):
    for trial in range(2):
        directory = tmp_path / str(trial)
        directory.mkdir()
        _finish(_start_job(directory, how))
        checkpoint.read_manifest(directory / "step-1")  # committed, whether waited for or not


def test_two_jobs_saving_to_one_path_end_with_one_checkpoint_and_one_clear_error(tmp_path):
    for trial in range(2):
        directory = tmp_path / str(trial)
        directory.mkdir()
        jobs = [_start_job(directory, "race"), _start_job(directory, "race")]
        outputs = [_finish(job) for job in jobs]
        verdicts = sorted("committed" if all("committed" in out for out in job) else "refused" for job in outputs)
        assert verdicts == ["committed", "refused"], outputs
        refused = next(job for job in outputs if not all("committed" in out for out in job))
        for out in refused:
            assert "refused: save:" in out and ("already exists" in out or "in progress" in out), out
        checkpoint.read_manifest(directory / "ckpt")
        assert sorted(os.listdir(directory)) == ["ckpt"]
