"""`.ci/run`'s jax 0.11.2 leg names the test directories it runs: a directory added to
tests/ must be named there or be one of those that leg leaves to the first."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEG_ONE_ONLY = {"server", "e2e"}  # HTTP, processes and files over the same engine


def test_the_jax_0_11_leg_runs_every_test_directory_but_the_frontends():
    script = (ROOT / ".ci" / "run").read_text()
    leg = script[script.index("'jax==0.11.2'"):script.index("--upgrade -e")]
    directories = {p.name for p in (ROOT / "tests").iterdir()
                   if p.is_dir() and any(p.glob("test_*.py"))}
    named = {d for d in directories if f"tests/{d} " in leg or f"tests/{d}\n" in leg}
    assert named == directories - LEG_ONE_ONLY
    assert "tests/e2e/test_device_probe.py" in leg  # the probe runs 0.11.2 on the H200
