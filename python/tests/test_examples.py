"""The examples on host memory, small: they check every byte themselves and exit non-zero
on any failure."""

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def run(script, *args):
    r = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True, text=True, timeout=50
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_kv_transfer(provider):
    out = run("kv_transfer.py", "--provider", provider, "--requests", "8", "--layers", "2", "--block-kib", "8")
    assert "0 failed" in out


def test_rl_weights(provider):
    out = run("rl_weights.py", "--provider", provider, "--model-mib", "4", "--versions", "2", "--tensors", "16")
    assert "every tensor of every version verified" in out


def test_examples_skip_cuda_without_a_driver():
    out = run("kv_transfer.py", "--device", "cuda:0", "--requests", "2")
    if not out.startswith("skipped"):
        pytest.skip("a CUDA device is present")


def test_disagg_prefill_on_the_cpu(provider):
    """A small model on the CPU: every decoder's tokens and logits equal the one-process run's."""
    pytest.importorskip("torch", reason="torch is not installed (disagg_prefill.py runs a torch model)")
    out = run("disagg_prefill.py", "--provider", provider, "--device", "cpu", "--layers", "2", "--hidden", "128",
              "--heads", "4", "--kv-heads", "2", "--vocab", "500", "--prompts", "40,100", "--decode-tokens", "4",
              "--rounds", "1")
    assert "0 mismatched" in out and "checked: 6 requests" in out


def test_disagg_prefill_without_torch_or_a_gpu_skips():
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present")
    except ImportError:
        pass
    out = run("disagg_prefill.py", "--device", "cuda:0")
    assert out.startswith("skipped"), out
