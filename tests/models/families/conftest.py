"""Fixtures for the family tests: what transformers' own module for a config.json holds, to check a
family's weight layout against."""

import pytest
import torch


@pytest.fixture(scope="session")
def transformers_weight_shapes():
    """hf config.json dict -> {tensor name: shape} of the transformers model built from it (on the meta
    device: no memory, so public models' full shapes are cheap). A tied lm_head is left out, as checkpoints
    leave it out."""
    transformers = pytest.importorskip("transformers")

    def shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
        fields = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
        cfg = transformers.AutoConfig.for_model(hf_config["model_type"], **fields)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert type(model).__name__ == hf_config["architectures"][0]
        # transformers 5 keeps MoE experts fused in memory; its save_pretrained reverts them to the per-expert
        # checkpoint names, which is what files hold.
        from transformers.modeling_utils import revert_weight_conversion

        state = revert_weight_conversion(model, model.state_dict())
        out = {name: tuple(t.shape) for name, t in state.items()}
        if cfg.tie_word_embeddings:
            out.pop("lm_head.weight")
        return out

    return shapes
