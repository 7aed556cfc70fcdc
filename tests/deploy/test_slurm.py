"""deploy/slurm: the sbatch script parses, its dry run prints what each node of an allocation
would run (checked line by line), and its launch path, under a stand-in srun, starts those
commands, restarts a part that fails and waits for the coordinator."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy" / "slurm"
SBATCH = SLURM / "jetrl.sbatch"
LINE = re.compile(r"^\[(?P<host>[^]]+)\] (?P<role>[\w-]+): (?P<cmd>.+)$")
HOSTS = [f"gpu{i:02d}" for i in range(1, 7)]
URLS = ["nats://gpu04:4222", "nats://gpu05:4222", "nats://gpu06:4222"]


def dry_run(nodelist: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    clean.update(
        {"DRY_RUN": "1", "JETRL_NODELIST": nodelist, "RUNS_DIR": "/shared/runs", "RUN_ID": "r1", **env}
    )
    return subprocess.run(
        ["bash", str(SBATCH), *args], env=clean, capture_output=True, text=True, timeout=60, check=False
    )


def plan(out: str) -> list[tuple[str, str, list[str]]]:
    """(host, role, argv) of every command line of a dry run."""
    rows = []
    for line in out.splitlines():
        if line.startswith("#"):
            continue
        m = LINE.match(line)
        assert m, f"not a plan line: {line!r}"
        rows.append((m["host"], m["role"], shlex.split(m["cmd"])))
    return rows


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} given {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("script", ["jetrl.sbatch", "lib.sh"])
def test_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(SLURM / script)], check=True, timeout=30)


def test_sbatch_header_asks_for_whole_nodes() -> None:
    header = [ln for ln in SBATCH.read_text().splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --nodes=6" in header and "#SBATCH --ntasks-per-node=1" in header
    assert SBATCH.read_text().count('scontrol show hostnames "$SLURM_JOB_NODELIST"') == 0  # in lib.sh
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in (SLURM / "lib.sh").read_text()


def test_dry_run_on_six_nodes_prints_each_nodes_commands() -> None:
    res = dry_run("gpu[01-06]", "configs/qwen3-30b-a3b.toml", TRAINER_NODES="2")
    assert res.returncode == 0, res.stderr
    rows = plan(res.stdout)
    by_role: dict[str, list[tuple[str, list[str]]]] = defaultdict(list)
    for host, role, argv in rows:
        assert host in HOSTS
        by_role[role].append((host, argv))
    assert set(by_role) == {
        "setup",
        "nats",
        "coordinator",
        "trainer",
        "inference",
        "producer",
        "recorder",
        "monitor",
    }

    # The NATS cluster: its configs written once, then 3 servers on 3 nodes, each its own file.
    ((setup_host, gen),) = by_role["setup"]
    assert setup_host == "gpu01" and gen[1] == "nats-config"
    assert flag(gen, "--hosts") == "gpu04,gpu05,gpu06"
    out_dir = flag(gen, "--out")
    nats = by_role["nats"]
    assert [h for h, _ in nats] == ["gpu04", "gpu05", "gpu06"]
    confs = [flag(argv, "-c") for _, argv in nats]
    assert all(argv[0] == "nats-server" for _, argv in nats)
    assert confs == [f"{out_dir}/jetrl-{k}.conf" for k in range(3)]
    assert flag(gen, "--name") == "jetrl"
    assert "{server}" in flag(gen, "--store-dir")  # one store a server
    assert "--auth-include" not in gen
    assert len(set(confs)) == 3

    # The trainer: one command per trainer node, node ranks 0..N-1, one rendezvous endpoint.
    trainer = by_role["trainer"]
    assert [h for h, _ in trainer] == ["gpu01", "gpu02"]
    assert [int(flag(argv, "--node-rank")) for _, argv in trainer] == [0, 1]
    assert {flag(argv, "--nnodes") for _, argv in trainer} == {"2"}
    assert {flag(argv, "--rdzv-endpoint") for _, argv in trainer} == {"gpu01:29500"}
    assert {flag(argv, "--run-dir") for _, argv in trainer} == {"/shared/runs/r1"}
    # Apart from the rank, every trainer node runs the very same command.
    stripped = {
        tuple(a for i, a in enumerate(argv) if i != argv.index("--node-rank") + 1) for _, argv in trainer
    }
    assert len(stripped) == 1

    # Inference on the nodes between the trainer and the control node, one worker a node.
    inference = by_role["inference"]
    assert [h for h, _ in inference] == ["gpu03", "gpu04", "gpu05"]
    assert [flag(argv, "--worker-id") for _, argv in inference] == ["inf-gpu03", "inf-gpu04", "inf-gpu05"]

    # The control node: coordinator, producer, recorder, monitor.
    for role in ("coordinator", "producer", "recorder", "monitor"):
        assert [h for h, _ in by_role[role]] == ["gpu06"], role
    ((_, coord),) = by_role["coordinator"]
    assert coord[:3] == ["jetrl", "run", "configs/qwen3-30b-a3b.toml"]
    assert flag(coord, "--run-id") == "r1" and flag(coord, "--parts") == "none"
    ((_, rec),) = by_role["recorder"]
    assert flag(rec, "--db") == flag(coord, "--db") == "sqlite:////shared/runs/r1/store.db"

    # Every jetrl command is given all 3 NATS URLs and the run.
    jetrl_cmds = [argv for role, rs in by_role.items() if role not in {"setup", "nats"} for _, argv in rs]
    assert len(jetrl_cmds) == 1 + 2 + 3 + 3
    for argv in jetrl_cmds:
        assert flag(argv, "--nats-url").split(",") == URLS
        if argv[1] == "part":
            assert flag(argv, "--run") == "r1"
            assert flag(argv, "--run-dir") == "/shared/runs/r1"  # one run directory, shared
            assert "--creds" not in argv  # no tenants directory given


def test_inference_per_gpu_and_credentials() -> None:
    res = dry_run(
        "gpu01,gpu02 gpu03",
        "cfg.toml",
        INFERENCE_PER="gpu",
        GPUS_PER_NODE="4",
        TENANTS_DIR="/shared/tenants",
        NATS_HOSTS="gpu01,gpu02,gpu03",
        MONITOR="0",
    )
    assert res.returncode == 0, res.stderr
    rows = plan(res.stdout)
    inference = [(h, argv) for h, role, argv in rows if role.startswith("inference")]
    (gen,) = [argv for _, role, argv in rows if role == "setup"]
    assert flag(gen, "--auth-include") == "../../../tenants/nats-auth.conf"  # from /shared/runs/r1/nats
    assert [h for h, _ in inference] == ["gpu02"] * 4
    assert [argv[:2] for _, argv in inference] == [["env", f"CUDA_VISIBLE_DEVICES={g}"] for g in range(4)]
    assert [flag(argv, "--worker-id") for _, argv in inference] == [f"inf-gpu02-g{g}" for g in range(4)]
    assert "monitor" not in {role for _, role, _ in rows}
    for _, role, argv in rows:
        if "part" in argv:
            kind = argv[argv.index("part") + 1]
            assert flag(argv, "--creds") == f"/shared/tenants/creds/{kind}.creds", role
        if role == "coordinator":
            assert flag(argv, "--tenants-dir") == "/shared/tenants"
    # One trainer node: no node flags, torchrun stays on its node.
    ((_, trainer),) = [(h, argv) for h, role, argv in rows if role == "trainer"]
    assert "--nnodes" not in trainer and "--node-rank" not in trainer


def test_an_external_nats_cluster_starts_no_servers() -> None:
    res = dry_run("n[1-3]", NATS_URL="nats://a:4222,nats://b:4222")
    assert res.returncode == 0, res.stderr
    rows = plan(res.stdout)
    assert {role for _, role, _ in rows}.isdisjoint({"setup", "nats"})
    assert all(flag(argv, "--nats-url") == "nats://a:4222,nats://b:4222" for _, _, argv in rows)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
        ("gpu[08-10,12],cpu5", ["gpu08", "gpu09", "gpu10", "gpu12", "cpu5"]),
        ("a b,c", ["a", "b", "c"]),
        ("rack1-n[1-2]-ib", ["rack1-n1-ib", "rack1-n2-ib"]),
    ],
)
def test_node_lists_expand_in_order(nodelist: str, hosts: list[str]) -> None:
    out = subprocess.run(
        ["bash", "-c", f'source "{SLURM / "lib.sh"}"; jetrl_expand_nodelist "$1"', "_", nodelist],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert out.split() == hosts


@pytest.mark.parametrize(
    ("nodelist", "env", "message"),
    [
        ("gpu[01-02]", {}, "no inference node"),
        ("gpu[01-04]", {"TRAINER_NODES": "2", "INFERENCE_NODES": "2"}, "> 4 allocated"),
        ("gpu[01-04]", {"INFERENCE_PER": "rack"}, "INFERENCE_PER"),
        ("gpu[01-03", {}, "cannot read"),
    ],
)
def test_bad_layouts_are_refused(nodelist: str, env: dict[str, str], message: str) -> None:
    res = dry_run(nodelist, **env)
    assert res.returncode != 0
    assert message in res.stderr
    assert not LINE.search(res.stdout)


FAKE_SRUN = r"""#!/bin/bash
# A stand-in for srun: runs the step's command once per node of --nodelist, on this machine,
# with the node's SLURM_NODEID, its output to --output (%N: the node).
nodes="" out=/dev/null
while [[ "$1" == -* ]]; do
    case "$1" in
        --nodelist=*) nodes="${1#--nodelist=}" ;;
        --output=*) out="${1#--output=}" ;;
    esac
    shift
done
IFS=, read -r -a hosts <<<"$nodes"
pids=()
for i in "${!hosts[@]}"; do
    SLURM_NODEID=$i SLURMD_NODENAME="${hosts[i]}" "$@" >>"${out//%N/${hosts[i]}}" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""

FAKE_JETRL = r"""#!/bin/bash
# A stand-in for jetrl: records where it ran and with what; the first inference worker fails
# once (to be restarted); the coordinator waits until every part has started.
echo "$SLURMD_NODENAME ${SLURM_NODEID:-} $*" >>"$CALLS"
if [[ "$1 $2" == "part inference" && "$*" == *inf-n3* && ! -e "$CALLS.failed" ]]; then
    touch "$CALLS.failed"
    exit 3
fi
if [[ "$1" == run ]]; then
    for _ in $(seq 100); do
        [[ $(grep -c " part " "$CALLS") -ge 6 ]] && exit 0
        sleep 0.1
    done
    exit 1
fi
exit 0
"""


def test_launch_path_under_a_stand_in_srun(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("jetrl", FAKE_JETRL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    calls = tmp_path / "calls"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        {
            "PATH": f"{bin_dir}:{env['PATH']}",
            "CALLS": str(calls),
            "SLURM_JOB_ID": "77",
            "JETRL_NODELIST": "n[1-4]",
            "TRAINER_NODES": "2",
            "NATS_URL": "nats://ext:4222",  # no servers to wait for on this machine
            "RUNS_DIR": str(tmp_path / "runs"),
            "JETRL_RESTART_DELAY_S": "0",
            "PART_GRACE_S": "20",
        }
    )
    res = subprocess.run(
        ["bash", str(SBATCH), "cfg.toml"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln.split(" ", 2) for ln in calls.read_text().splitlines()]
    # Each trainer node got its own rank from its step's SLURM_NODEID, appended by bash -c.
    trainer = sorted((host, nodeid, rest) for host, nodeid, rest in lines if rest.startswith("part trainer"))
    assert [(h, n) for h, n, _ in trainer] == [("n1", "0"), ("n2", "1")]
    for _, nodeid, rest in trainer:
        argv = rest.split()
        assert flag(argv, "--node-rank") == nodeid and flag(argv, "--rdzv-endpoint") == "n1:29500"
        assert flag(argv, "--nats-url") == "nats://ext:4222"
    # The worker that failed was started again, once; the other once.
    inference = [host for host, _, rest in lines if rest.startswith("part inference")]
    assert sorted(inference) == ["n3", "n3"]
    assert {
        host for host, _, rest in lines if rest.split()[:2] in (["run", "cfg.toml"], ["part", "producer"])
    } == {"n4"}
    log_dir = tmp_path / "runs" / "jetrl-77" / "slurm"
    assert "restart 1 of 5" in (log_dir / "n3.inference.log").read_text()
    assert {p.name for p in log_dir.iterdir()} >= {"n1.trainer.log", "n2.trainer.log", "n4.coordinator.log"}
