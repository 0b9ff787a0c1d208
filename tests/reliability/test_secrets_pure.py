"""Issue 8, redaction (pure): hundreds of planted secrets of dozens of kinds, none survives.

Every carrier of every secret in tests/reliability/secrets.py goes through the product's own
redaction entry points: `redact_text` (logs, command output, command lines: what
runbooks/collect/collector.py writes), `redact_json` (docker inspect:
runbooks/collect/collector.py, the fix
journal in runbooks/fix/fixer.py) and `dockerrun.run_args` (the `docker run` shown in plans and
reports). Ordinary GPU evidence must come through unchanged.
"""

from __future__ import annotations

import json
import shlex
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from runbooks.collect.redact import MASK, redact_argv, redact_json, redact_text
from runbooks.fix.dockerrun import run_args
from tests.reliability.figures import record, size, zero
from tests.reliability.secrets import KINDS, Planted, corpus, find_leaks
from tests.test_redact import BENIGN

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PLANTED = corpus(seed=8, per_kind=size(10, 10))

# Evidence that looks a little like a secret (hex, base64-ish, key=value) and must survive.
BENIGN_EVIDENCE = [
    *BENIGN,
    "|   0  NVIDIA H100 80GB HBM3     On  | 00000000:3B:00.0 Off |                    0 |",
    "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5c2a7f4e-1b3d-9e8f-a0b1-c2d3e4f5a6b7)",
    "NVIDIA_VISIBLE_DEVICES=GPU-5c2a7f4e-1b3d-9e8f-a0b1-c2d3e4f5a6b7,GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
    "MIG-1d2c3b4a-5f6e-7d8c-9b0a-1f2e3d4c5b6a",
    "3b:00.0 3D controller [0302]: NVIDIA Corporation GH100 [H100 SXM5 80GB] [10de:2330] (rev a1)",
    "[ 1234.567890] NVRM: GPU at PCI:0000:3b:00: GPU-5c2a7f4e-1b3d-9e8f-a0b1-c2d3e4f5a6b7",
    "[ 1234.567891] NVRM: Xid (PCI:0000:3b:00): 48, pid=2345, name=python, An uncorrectable "
    "double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, "
    "subpartition 0.",
    "Image: nvcr.io/nvidia/pytorch:24.01-py3@sha256:"
    "4ea3e37f7a1a1e9b6b0c5f3f0d4f6f2b8a9c7e5d3b1a0f9e8d7c6b5a4f3e2d1c",
    '"Image": "sha256:4ea3e37f7a1a1e9b6b0c5f3f0d4f6f2b8a9c7e5d3b1a0f9e8d7c6b5a4f3e2d1c"',
    "Id: 9f3c2b1a0e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b",
    "commit 1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e (HEAD -> main)",
    "torch 2.3.0+cu121, git version: 97ff6cfd9c86c5c09d7ce775ab64ec5c99230f5d",
    "gpu-07 NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.7<0>",
    "gpu-07:1234:1234 [0] NCCL INFO Bootstrap : Using eth0:172.17.0.2<0>",
    "NCCL INFO comm 0x55d5c8a0e4f0 rank 0 nranks 8 cudaDev 0 busId 3b000 commId "
    "0x8a7b6c5d4e3f2a1b - Init COMPLETE",
    "CUDA_VISIBLE_DEVICES=0,1,2,3 NCCL_DEBUG=INFO NCCL_IB_HCA=mlx5 NCCL_SOCKET_IFNAME=eth0",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
    "(GPU 0; 79.10 GiB total capacity; 75.12 GiB already allocated)",
    "step=1200 loss=2.3141 lr=3.0e-04 grad_norm=0.913 tokens/s=41235",
    "docker run --gpus all --shm-size 64g -v /data:/data -p 8080:80 nvcr.io/nvidia/pytorch:24.01",
    "docker login nvcr.io && docker run -p 8080:80 -u 1000:1000 vllm/vllm-openai:v0.5.0",
    "ssh -p 2222 root@gpu-07 nvidia-smi",
    "-v /secrets/id_rsa.pub:/root/.ssh/authorized_keys:ro",
    "Initializing an LLM engine (v0.5.0) with config: model='meta-llama/Llama-2-7b-hf', "
    "tokenizer='meta-llama/Llama-2-7b-hf', tokenizer_mode=auto, max_num_batched_tokens=8192",
    "wandb: Run `wandb login` or set WANDB_MODE=offline",
    'FATAL:  password authentication failed for user "postgres"',
    "pip install git+https://github.com/NVIDIA/apex.git@23.08 http://[::1]:8000/v1/models",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05",
    "Driver Version: 535.104.05   CUDA Version: 12.2",
    "pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:3b:00.0",
    "ssh: connect to host gpu-07 port 22: Connection refused",
    "Downloading https://huggingface.co/meta-llama/Llama-3-8B/resolve/main/config.json",
    "base64 blob: SGVsbG8sIHdvcmxkIQ==",
]


def _inspect(p: Planted, i: int) -> dict[str, Any]:
    """A docker-inspect-shaped dict carrying one secret everywhere a secret is found in practice."""
    nested = json.dumps({"job": f"train-{i}", p.env_name: p.env_value})
    return {
        "Id": f"{i:064x}",
        "Name": f"/train-{i}",
        "Path": p.argv[0],
        "Args": list(p.argv[1:]),
        "Image": f"sha256:{i:064x}",
        "Config": {
            "Env": ["PATH=/usr/local/sbin:/usr/bin", "NCCL_DEBUG=INFO", p.env],
            "Labels": {"team": "ml", p.label_key: p.label_value, "app.config": nested},
            "Cmd": list(p.argv),
            "Entrypoint": ["/bin/sh", "-c", shlex.join(p.argv)],
            "Healthcheck": {"Test": ["CMD-SHELL", shlex.join(p.argv)]},
            "Image": "nvcr.io/nvidia/pytorch:24.01-py3",
        },
        "HostConfig": {
            "Binds": ["/data:/data:ro"],
            "LogConfig": {"Type": "json-file", "Config": {"env": p.env_name}},
        },
    }


def _outputs(planted: list[Planted]) -> list[tuple[str, str]]:
    """(carrier, redacted text) for every carrier of every planted secret."""
    out: list[tuple[str, str]] = []
    for i, p in enumerate(planted):
        out.append(("env line", redact_text(p.env)))
        out.append(("log line", redact_text(p.log)))
        out.append(("command line (quoted)", redact_text(shlex.join(p.argv))))
        out.append(("command line (ps)", redact_text(" ".join(p.argv))))
        inspect = _inspect(p, i)
        out.append(("docker inspect", json.dumps(redact_json(inspect))))
        out.append(("docker run", "\n".join(run_args(inspect))))
    # All at once, as one container's `env`, log and inspect.
    out.append(("env", redact_text("\n".join(p.env for p in planted))))
    out.append(("log", redact_text("\n".join(p.log for p in planted))))
    everything = {
        "Config": {
            "Env": [p.env for p in planted],
            "Labels": {p.label_key: p.label_value for p in planted},
        }
    }
    out.append(("docker inspect (all)", json.dumps(redact_json(everything))))
    return out


def test_corpus_is_large_and_varied() -> None:
    kinds = {p.kind for p in PLANTED}
    record("secrets", "planted secrets", len(PLANTED))
    record("secrets", "kinds", len(kinds), ">= 30", len(kinds) >= 30)
    assert kinds == set(KINDS)
    assert len(kinds) >= 30 and len(PLANTED) >= 300
    needles = [n for p in PLANTED for n in p.needles]
    assert len(needles) == len(set(needles)), "every needle is unique"
    assert all(len(n) >= 12 for n in needles)
    envs = [p.env_name for p in PLANTED]
    labels = [p.label_key for p in PLANTED]
    assert len(set(envs)) == len(envs) and len(set(labels)) == len(labels)
    # Same seed, same corpus; another seed, other values.
    assert corpus(seed=8, per_kind=2) == corpus(seed=8, per_kind=2)
    assert not find_leaks("\n".join(p.log for p in corpus(seed=9, per_kind=2)), PLANTED)


def test_find_leaks_sees_plain_json_escaped_and_url_quoted_forms() -> None:
    p = next(p for p in PLANTED if p.kind == "env-db-password" and "%" not in p.value)
    pem = next(p for p in PLANTED if p.kind == "rsa-private-key")
    assert find_leaks(f"x {p.value} y", [p]) == [(p.kind, p.value[:12])]
    assert find_leaks(json.dumps({"k": pem.value}), [pem])
    assert find_leaks("url?x=" + urllib.parse.quote(pem.value, safe=""), [pem])
    one_line = pem.value.splitlines()[2]
    assert find_leaks(f"...{one_line}...", [pem]) == [(pem.kind, one_line[:12])]
    assert find_leaks("nothing here", PLANTED) == []


def test_no_planted_secret_survives_redaction() -> None:
    leaks = [
        (carrier, kind, prefix)
        for carrier, text in _outputs(PLANTED)
        for kind, prefix in find_leaks(text, PLANTED)
    ]
    zero("secrets", "leaks after redaction (env/labels/cmdline/logs, pure)", len(leaks))
    assert leaks == []


@pytest.mark.parametrize("line", BENIGN_EVIDENCE)
def test_benign_evidence_is_not_redacted(line: str) -> None:
    assert redact_text(line) == line


def test_fixtures_are_not_redacted() -> None:
    """Real command output (dmesg, nvidia-smi, nccl-tests, host commands) comes through whole."""
    files = [f for f in FIXTURES.rglob("*") if f.suffix in (".txt", ".xml", ".log")]
    assert len(files) > 50
    changed = [str(f.relative_to(FIXTURES)) for f in files if redact_text(t := f.read_text()) != t]
    assert changed == []


def test_benign_inspect_is_not_redacted() -> None:
    inspect = {
        "Id": "9f3c2b1a0e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b",
        "Image": "sha256:4ea3e37f7a1a1e9b6b0c5f3f0d4f6f2b8a9c7e5d3b1a0f9e8d7c6b5a4f3e2d1c",
        "Path": "torchrun",
        "Args": ["--nproc-per-node", "8", "train.py", "--batch-size", "64", "--lr", "3e-4"],
        "Config": {
            "Env": [
                "PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/bin",
                "NVIDIA_VISIBLE_DEVICES=GPU-5c2a7f4e-1b3d-9e8f-a0b1-c2d3e4f5a6b7",
                "CUDA_VERSION=12.3.2",
                "NCCL_IB_HCA=mlx5_0,mlx5_1",
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            ],
            "Labels": {
                "com.nvidia.cudnn.version": "8.9.7.29",
                "org.opencontainers.image.revision": "97ff6cfd9c86c5c09d7ce775ab64ec5c99230f5d",
            },
            "Cmd": ["torchrun", "--nproc-per-node", "8", "train.py", "--batch-size", "64"],
            "Entrypoint": ["/opt/nvidia/nvidia_entrypoint.sh"],
        },
        "HostConfig": {
            "Binds": ["/data:/data:ro", "/secrets/ca.pem:/etc/ssl/ca.pem:ro"],
            "ShmSize": 68719476736,
            "DeviceRequests": [{"Driver": "nvidia", "Count": -1, "Capabilities": [["gpu"]]}],
        },
    }
    assert redact_json(inspect) == inspect


def test_argument_lists_keep_their_shape() -> None:
    argv = ["python", "train.py", "--token", "abc123456789", "--lr", "3e-4"]
    assert redact_argv(argv) == ["python", "train.py", "--token", MASK, "--lr", "3e-4"]
    # Inside an argument list a value's end is known: spaces in it are masked too.
    assert redact_argv(["sshpass", "-p", "pw 12 3", "ssh", "gpu-07"])[2] == MASK
    assert redact_argv(["app", "--password=pw 12 3"]) == ["app", f"--password={MASK}"]
    assert redact_argv(["curl", "-u", "me:pw 12", "x"])[2] == f"me:{MASK}"
    inspect = {"Path": "docker", "Args": ["login", "-u", "me", "-p", "s3cret-pw", "nvcr.io"]}
    assert redact_json(inspect)["Args"] == ["login", "-u", "me", "-p", MASK, "nvcr.io"]
    assert redact_argv(["torchrun", "--nproc-per-node", "8"]) == [
        "torchrun",
        "--nproc-per-node",
        "8",
    ]


@pytest.mark.parametrize(
    "unit",
    [
        *("-a", "login ", "curl ", "token", "tokenizer=", "a.", "sk-", "wandb login ", "--"),
        *("a://u:", "x://u:a/", "--pw x ", "set password ", "password\t", "redis-cli -a "),
        *("-----END RSA PRIVATE KEY-----\n", "'password': '", "<password>"),
    ],
)
def test_redaction_stays_linear_on_hostile_text(unit: str) -> None:
    """No pattern rescans a long run from every position (this took minutes before)."""
    text = unit * (300_000 // len(unit))
    start = time.perf_counter()
    redact_text(text)
    assert time.perf_counter() - start < 5.0
