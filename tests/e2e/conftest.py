"""Real vLLM end to end: fixtures shared by the in-process and the
multi-process tests.

Every test here is marked ``e2e`` and deselected from the default run (see
setup.cfg). Run them in the venv ``tests/e2e/make_venv.sh`` builds::

    python -m pytest -q -n 0 -m e2e tests/e2e

Without vLLM they fail, never skip. Each vLLM start costs 30-40 s on a
2-core host, so each phase is one process that checks as much as it can,
and all phases share one model and one set of prompts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from e2e.vllm_phases import PHASE_TIMES, PROMPT_LENGTHS, run_phase


@pytest.fixture(scope="session", autouse=True)
def _vllm_installed() -> None:
    """Each test here fails (never skips) outside the e2e venv."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "vLLM is not installed in this venv: build the e2e venv with "
            "tests/e2e/make_venv.sh VENV_DIR and run the suite from it"
        )


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama, saved once (no downloads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def baseline(model_dir: Path, workdir: Path) -> dict[str, Any]:
    """vLLM without any connector: the token ids every phase must match."""
    result, _ = run_phase(
        "baseline",
        workdir,
        {"model": str(model_dir), "connector": "none", "api": "llm"},
    )
    assert result["cached"] == [0] * len(PROMPT_LENGTHS)
    return result


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if PHASE_TIMES:
        terminalreporter.section("e2e phase wall times")
        for name, seconds in PHASE_TIMES:
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
        total = sum(s for _, s in PHASE_TIMES)
        terminalreporter.write_line(f"all phases: {total:.1f} s")
