"""DSA with multi-token-prediction (MTP) layers, built the way each entry point builds it.

A tiny MLA + DSA GPT with `mtp_num_layers=1` on CPU: every DSA module, the decoder's and the MTP
layer's, must be HyScale's, and one training step must give stock's loss and gradients on the
same weights.

- Python: `specs.get_dsa_block_spec` + `specs.get_dsa_mtp_block_spec` (no Megatron-LM needed).
- Megatron-LM's `pretrain_gpt.py` (core_r0.19): it builds GPT models with megatron.training's
  `gpt_config_from_args` + `GPTModelBuilder` (in the megatron-core wheel), whose MTP spec
  ignores `--spec` and asserts on DSA; `patches/megatron_lm_mtp_spec.patch` makes it take the
  `--spec` block's last layer. The test applies the patch to a copy of the wheel's module
  (`git apply --check` first) and builds through it with `--spec megatron_hyscale.specs
  hyscale_dsa_block_spec`. Megatron-LM's older `gpt_builders.gpt_builder` (carried in
  .carry/megatron_lm by scripts/megatron_lm_carry.sh; skipped without) fails loudly with
  `--spec` + `--mtp-num-layers`, never building stock MTP layers.
- A model whose MTP layers do not run HyScale's DSA beside HyScale's decoder warns once
  (`specs.mtp_check`).
(Megatron-Bridge's entry: tests/test_bridge.py.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention
from megatron.core.transformer.moe.moe_layer import MoELayer

from hyscale_bench.cpu import init_single_process, megatron_on_cpu
from hyscale_bench.models import default_device, tiny_dsa_config
from megatron_hyscale.layers.dsa import HyScaleDSAttention
from megatron_hyscale.ops import checks
from megatron_hyscale.specs import (
    dsa_layer_spec_for,
    get_dsa_block_spec,
    get_dsa_layer_specs,
    get_dsa_mtp_block_spec,
)
from megatron_hyscale.specs.mtp_check import WARNING_KEY, mtp_attention_mismatch
from megatron_hyscale.testing.mtp import (
    assert_dsa_everywhere,
    assert_mtp_model_matches_stock,
    mtp_step,
)

DEVICE = default_device()
VOCAB, T = 97, 64
ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "patches" / "megatron_lm_mtp_spec.patch"
CARRY = ROOT / ".carry" / "megatron_lm"
PATCHED_FILE = "megatron/training/models/gpt.py"


@pytest.fixture(scope="module", autouse=True)
def megatron_env() -> Iterator[None]:
    with megatron_on_cpu() if DEVICE.type == "cpu" else contextlib.nullcontext():
        init_single_process()
        yield


def mtp_config(**overrides: Any) -> Any:
    return tiny_dsa_config(mtp_num_layers=1, mtp_loss_scaling_factor=0.3, **overrides)


def gpt(config: Any, block: Any, mtp: Any) -> GPTModel:
    torch.manual_seed(7)
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=VOCAB,
                    max_sequence_length=T, pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=False, position_embedding_type="none",
                    mtp_block_spec=mtp).to(DEVICE)


@contextlib.contextmanager
def mtp_warnings() -> Iterator[list[str]]:
    """The MTP-attention warnings given inside the block (the once-a-process key reset)."""
    checks._warned.discard(WARNING_KEY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shown: list[str] = []
        yield shown
    shown += [str(w.message) for w in caught if "multi-token-prediction" in str(w.message)]
    checks._warned.discard(WARNING_KEY)


# --------------------------------------------------------------------------- Python


def test_hyscale_mtp_block_spec_runs_hyscale_dsa_and_matches_stock() -> None:
    config = mtp_config()
    with mtp_warnings() as shown:
        hyscale = gpt(config, get_dsa_block_spec(config), get_dsa_mtp_block_spec(config))
        stock = gpt(config, get_dsa_block_spec(config, stock=True),
                    get_dsa_mtp_block_spec(config, stock=True))
    assert shown == []
    assert_dsa_everywhere(hyscale, HyScaleDSAttention)
    assert_dsa_everywhere(stock, DSAttention)
    assert_mtp_model_matches_stock(hyscale, stock, vocab=VOCAB, seq=T, what="MTP (Python)")


def test_layer_spec_entry_builds_the_block_specs_model() -> None:
    """`hyscale_dsa_layer_spec` (one ModuleSpec for every layer) with HyScale's MTP block: the
    same modules, parameter names and loss as the block spec's model."""
    from megatron_hyscale.specs import hyscale_dsa_layer_spec

    config = mtp_config()
    from_entry = gpt(config, hyscale_dsa_layer_spec, get_dsa_mtp_block_spec(config))
    assert_dsa_everywhere(from_entry, HyScaleDSAttention)
    from_block = gpt(config, get_dsa_block_spec(config), get_dsa_mtp_block_spec(config))
    from_block.load_state_dict(from_entry.state_dict(), strict=True)
    loss, _ = mtp_step(from_entry, vocab=VOCAB, seq=T)
    expected, _ = mtp_step(from_block, vocab=VOCAB, seq=T)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_mtp_layer_is_the_last_decoder_layer() -> None:
    """Dense first layer, MoE last: the MTP layer's inner layer is the last (MoE) one, from the
    full layer list (so also on a stage without decoder layers), and the `--spec` ModuleSpec
    entry resolves a layer by its global number (this stage's offset added)."""
    config = mtp_config(num_moe_experts=2, moe_layer_freq=[0, 1], moe_ffn_hidden_size=32,
                        moe_router_topk=2, pipeline_model_parallel_size=2,
                        pipeline_dtype=torch.float32)
    mtp = get_dsa_mtp_block_spec(config, pp_rank=1)
    inner = mtp.layer_specs[0].submodules.mtp_model_layer
    assert is_moe(inner)
    assert inner.submodules.self_attention.submodules.core_attention.module is HyScaleDSAttention
    assert is_moe(dsa_layer_spec_for(config, 1, is_mtp_layer=True))
    assert not is_moe(dsa_layer_spec_for(config, 1, pp_rank=0))
    assert is_moe(dsa_layer_spec_for(config, 1, pp_rank=1))
    assert is_moe(dsa_layer_spec_for(config, 2, add_layer_offset=False))


def is_moe(layer_spec: Any) -> bool:
    mlp = layer_spec.submodules.mlp  # a ModuleSpec or a partial of the module class
    return getattr(mlp, "module", getattr(mlp, "func", None)) is MoELayer


# --------------------------------------------------------------------------- Megatron-LM


def megatron_lm_args(spec: str | None, **overrides: Any) -> types.SimpleNamespace:
    """The `args` fields Megatron-LM's model builders read (pretrain_gpt.py's command line)."""
    fields: dict[str, Any] = dict(
        spec=["megatron_hyscale.specs", spec] if spec else None, yaml_cfg=None,
        fp16_lm_cross_entropy=False, position_embedding_type="none", rotary_percent=1.0,
        rotary_base=10000, make_vocab_size_divisible_by=128, use_rope_scaling=False,
        rotary_seq_len_interpolation_factor=None, max_position_embeddings=T,
        untie_embeddings_and_output_weights=True, padded_vocab_size=VOCAB, vocab_size=None,
        transformer_impl="local", experimental_attention_variant="dsa", num_experts=None,
        heterogeneous_layers_config_path=None, mtp_num_layers=1, normalization="RMSNorm",
        qk_l2_norm=False)
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def apply_patch(directory: Path, *, check_only: bool = False) -> None:
    """`git apply` the MTP patch in `directory` (outside any git checkout)."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(directory.parent)}
    command = ["git", "apply", *(["--check"] if check_only else []), str(PATCH)]
    done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)} in {directory}: {done.stderr}"


@pytest.fixture(scope="module")
def patched_gpt_module(tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    """megatron.training.models.gpt with patches/megatron_lm_mtp_spec.patch, from a copy of the
    installed megatron-core wheel's file (the same file as Megatron-LM core_r0.19.0's)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    import megatron.training.models.gpt as unpatched

    tree = tmp_path_factory.mktemp("megatron_lm")
    target = tree / PATCHED_FILE
    target.parent.mkdir(parents=True)
    shutil.copyfile(unpatched.__file__, target)
    apply_patch(tree, check_only=True)
    apply_patch(tree)
    return load_module("hyscale_test_patched_megatron_gpt", target)


def test_patch_names_its_megatron_lm_commit() -> None:
    text = PATCH.read_text()
    assert "core_r0.19.0 (f8837c04ef6cbef6cdefb8de001aad63178aebbf)" in text
    if (CARRY / "SOURCE").exists():
        source = (CARRY / "SOURCE").read_text().split()
        if source[0] == "core_r0.19.0":
            assert source[1] in text


def test_patch_applies_to_carried_megatron_lm() -> None:
    """Where a Megatron-LM checkout is carried whole (MEGATRON_LM_DIR with megatron/training),
    the patch applies to it as well."""
    root = Path(os.environ.get("MEGATRON_LM_DIR", CARRY))
    if not (root / PATCHED_FILE).exists():
        pytest.skip(f"no {PATCHED_FILE} under {root} (scripts/megatron_lm_carry.sh carries the "
                    "scripts only; the wheel's copy is checked by the next tests)")
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)}
    done = subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=root, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def build_like_pretrain_gpt(builder_module: types.ModuleType, spec: str | None,
                            config: Any) -> GPTModel:
    """What pretrain_gpt.py (core_r0.19) does: gpt_config_from_args(args) -> the config's
    GPTModelBuilder -> build_model on this (only) pipeline stage."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args

    model_config = gpt_config_from_args(megatron_lm_args(spec), config=config)
    torch.manual_seed(7)
    model = builder_module.GPTModelBuilder(model_config).build_model(
        ProcessGroupCollection.use_mpu_process_groups(), pre_process=True, post_process=True)
    return model.to(DEVICE)


def test_pretrain_gpt_builds_models_through_megatron_training() -> None:
    """The carried pretrain_gpt.py builds with gpt_config_from_args (the module the patch
    changes), not gpt_builders.gpt_builder."""
    script = CARRY / "pretrain_gpt.py"
    if not script.exists():
        pytest.skip("no .carry/megatron_lm (bash scripts/megatron_lm_carry.sh MEGATRON_LM_GIT)")
    text = script.read_text()
    assert "gpt_config_from_args(args" in text
    assert "partial(model_provider, gpt_builder)" not in text


def test_unpatched_megatron_lm_refuses_dsa_with_mtp() -> None:
    """Without the patch pretrain_gpt.py cannot build DSA with MTP layers at all (HyScale's
    `--spec` or not): loud, not stock MTP layers."""
    import megatron.training.models.gpt as unpatched

    with pytest.raises(AssertionError, match="Experimental attention variant"):
        build_like_pretrain_gpt(unpatched, "hyscale_dsa_block_spec", mtp_config())


def test_megatron_lm_spec_entry_runs_hyscale_dsa_in_mtp_layers(
        patched_gpt_module: types.ModuleType) -> None:
    with mtp_warnings() as shown:
        hyscale = build_like_pretrain_gpt(patched_gpt_module, "hyscale_dsa_block_spec",
                                          mtp_config())
        stock = build_like_pretrain_gpt(patched_gpt_module, "stock_dsa_block_spec",
                                        mtp_config())
    assert shown == []
    assert_dsa_everywhere(hyscale, HyScaleDSAttention)
    assert_dsa_everywhere(stock, DSAttention)
    assert_mtp_model_matches_stock(hyscale, stock, vocab=VOCAB, seq=T,
                                   what="MTP (Megatron-LM --spec)")


def test_patched_megatron_lm_without_spec_is_unchanged(
        patched_gpt_module: types.ModuleType) -> None:
    """No `--spec`: the patched builder takes megatron's own path (here: megatron's DSA block
    spec needs Transformer Engine, as before)."""
    import megatron.training.models.gpt as unpatched

    for module in (unpatched, patched_gpt_module):
        with pytest.raises(AssertionError, match="transformer engine"):
            build_like_pretrain_gpt(module, None, mtp_config())


def test_megatron_lm_gpt_builder_never_builds_stock_mtp_silently() -> None:
    """Megatron-LM's gpt_builders.gpt_builder (inference and checkpoint tools; not
    pretrain_gpt.py at core_r0.19) with `--spec` and `--mtp-num-layers`: it fails (megatron's
    DSA layer specs need Transformer Engine; with it, `use_te` is unbound under `--spec`)."""
    path = CARRY / "gpt_builders.py"
    if not path.exists():
        pytest.skip("no .carry/megatron_lm (bash scripts/megatron_lm_carry.sh MEGATRON_LM_GIT)")
    sys.path.insert(0, str(CARRY))
    try:
        gpt_builders = load_module("hyscale_test_gpt_builders", path)
    finally:
        sys.path.remove(str(CARRY))
    for spec in ("hyscale_dsa_layer_spec", "hyscale_dsa_block_spec"):
        with pytest.raises((AssertionError, UnboundLocalError)):
            gpt_builders.gpt_builder(megatron_lm_args(spec), True, True, config=mtp_config())


# --------------------------------------------------------------------------- the check


def test_stock_mtp_beside_hyscale_decoder_warns_once() -> None:
    """HyScale's decoder with megatron-core's MTP layer spec (what megatron's builders give
    when they ignore HyScale's spec): one warning naming the fix, at build time."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    config = mtp_config()
    stock_mtp = get_gpt_mtp_block_spec(config, get_dsa_layer_specs(config, stock=True)[-1],
                                       use_transformer_engine=False)
    with mtp_warnings() as shown:
        mixed = gpt(config, get_dsa_block_spec(config), stock_mtp)
        gpt(config, get_dsa_block_spec(config), stock_mtp)  # once a process
    assert len(shown) == 1, shown
    assert "DSAttention" in shown[0] and "hyscale_dsa_block_spec" in shown[0]
    assert "get_dsa_mtp_block_spec" in shown[0] and "use_hyscale" in shown[0]
    assert set(mtp_attention_mismatch(mixed.decoder, mixed.mtp)) == {
        "layers.0.mtp_model_layer.self_attention.core_attention"}
    # a stage holding only the MTP layers: no decoder attention to compare with
    assert mtp_attention_mismatch(None, mixed.mtp, expect_hyscale=True)
    assert not mtp_attention_mismatch(None, mixed.mtp, expect_hyscale=False)

    with mtp_warnings() as shown:  # all stock: nothing to say
        gpt(config, get_dsa_block_spec(config, stock=True), stock_mtp)
    assert shown == []
