"""`detinfer audit`: deterministic mode passes; an injected batch-dependent op is named exactly."""

import pytest

from detinfer.engine.config import EngineConfig
from detinfer.repro.audit import AuditConfig, Finding, audit, build_runner, main, report

ENGINE = EngineConfig(max_model_len=64, num_kv_blocks=96, max_num_seqs=16, max_num_batched_tokens=256)
CFG = AuditConfig(prompts=2, max_len=12, batches=1, chunkings=1, max_others=3, seed=5)


@pytest.fixture(scope="module")
def runner(tiny_chat_model):
    return build_runner(tiny_chat_model, None, "deterministic", ENGINE, "cpu", 0)


def test_deterministic_mode_is_invariant(runner):
    r, vocab = runner
    findings = audit(r, vocab, CFG)
    assert len(findings) == CFG.prompts * (1 + CFG.batches + CFG.chunkings)
    assert {f.scenario for f in findings} == {"alone again", "batch", "chunked"}
    assert all(f.name is None for f in findings), report(findings, "deterministic")


def test_a_batch_dependent_op_is_named(runner):
    """Negative control: make layer 1's down_proj add a trace of the batch mean. Every output before it is
    still invariant, so the audit must point at exactly that module, and only when the batch differs."""
    r, vocab = runner
    target = r.model.layers[1].mlp.down_proj
    handle = target.register_forward_hook(lambda mod, args, out: out + 1e-3 * out.mean(0, keepdim=True))
    try:
        findings = audit(r, vocab, CFG)
    finally:
        handle.remove()
    by_kind = {}
    for f in findings:
        by_kind.setdefault(f.scenario, []).append(f)
    assert all(f.name is None for f in by_kind["alone again"])  # same batch, same bits
    for f in by_kind["batch"] + by_kind["chunked"]:
        assert f.name == "layers.1.mlp.down_proj", report(findings, "patched")
        assert f.token is not None and f.num_diff > 0 and f.max_abs_diff > 0
    assert "DIFFERS first at layers.1.mlp.down_proj" in report(findings, "patched")


def test_report_wording():
    text = report([Finding(0, "batch"), Finding(1, "chunked", "logits", 3, 1e-7, 2, 10)], "fast")
    assert "[fast] prompt 0 batch        invariant" in text
    assert "DIFFERS first at logits (prompt token 3; 2/10 elements, max |diff| 1e-07)" in text
    assert text.endswith("fast: 1/2 scenarios bit-identical to the prompt alone")


def test_cli_random_model(capsys):
    rc = main(["--random-model", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "1", "--max-len",
               "8", "--batches", "1", "--chunkings", "1", "--num-kv-blocks", "64"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "deterministic: 3/3 scenarios bit-identical" in out


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([])
    assert main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([str(tmp_path), "--prompts", "0"]) == 2
    with pytest.raises(ValueError):
        AuditConfig(max_len=1)
