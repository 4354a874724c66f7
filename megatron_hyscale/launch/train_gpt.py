"""HyScale's own minimal GPT pretraining entry point, on megatron.training's public API.

    torchrun ... -m megatron_hyscale.launch.train_gpt [Megatron-LM's pretrain_gpt.py arguments]

Why it exists: Megatron-LM's `pretrain_gpt.py` is not in any pip package. The megatron-core
wheel ships `megatron.training` (argument parser, `pretrain`, the training loop and its log)
but not the script that ties a model, a dataset and a loss to it, so a machine without a
Megatron-LM checkout (CI: PyPI but no GitHub) could not run a training at all. This module is
that glue, written for HyScale: the evaluation's `--trainer hyscale`
(`python -m megatron_hyscale.evaluate`) and its CPU smoke test run it.

Your real runs should use Megatron-LM's own `pretrain_gpt.py` (`--trainer megatron-lm`, the
evaluation's default when MEGATRON_LM_DIR or .carry/megatron_lm is found): it follows
Megatron-LM's features (SFT, FIM, packed documents, MTP across pipeline stages, ModelOpt,
in-process restart, offline distillation), which this one refuses rather than imitates.

What it does, and nothing more:
- parses and validates Megatron's arguments (`megatron.training.arguments`; same defaults as
  pretrain_gpt.py, GPT2BPETokenizer unless `--tokenizer-type` says otherwise), including
  `--spec MODULE FUNCTION` for the layer spec, `--mock-data` or `--data-path` with any tokenizer
  megatron.training builds (NullTokenizer for token-id corpora), MLA / DSA / MoE arguments;
- builds `GPTModel` through megatron.training's `GPTModelConfig` (`gpt_config_from_args`);
- builds `GPTDataset` / `MockGPTDataset` with `BlendedMegatronDatasetBuilder` on the first
  tensor-parallel rank of the first and last pipeline stages;
- a forward step that broadcasts the batch over tensor parallelism, splits it over context
  parallelism (megatron.core.utils), and sums the masked per-token losses ('lm loss', checked
  for NaN / Inf like Megatron-LM's);
- `megatron.training.pretrain`, so the training loop, checkpoints and the log (what
  megatron_hyscale.launch.logparse reads) are Megatron's own.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
)
from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import (
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import (
    get_args,
    get_timers,
    get_tokenizer,
    pretrain,
    print_rank_0,
)
from megatron.training.argument_utils import (
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import (
    get_blend_and_blend_per_split,
    is_first_or_last_pipeline_stage,
)

from megatron_hyscale.launch.command import HYSCALE_TRAINER_BANNER

# (argument, what it asks for): Megatron-LM features this entry point does not implement.
UNSUPPORTED = (
    ("sft", "--sft (supervised fine-tuning data)"),
    ("fim_data", "--fim-data (fill-in-the-middle data)"),
    ("dataloader_inter_document_masking", "--dataloader-inter-document-masking (packed THD "
                                          "documents)"),
    ("hybrid_context_parallel", "--hybrid-context-parallel"),
    ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm (needs a "
                                         "schedule-plan forward step)"),
    ("inprocess_restart", "--inprocess-restart"),
    ("logits_load_dir", "--logits-load-dir (offline distillation)"),
)

_BATCH_FIELDS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def check_supported(args: Any) -> None:
    """Refuse, naming the argument, what only Megatron-LM's pretrain_gpt.py implements."""
    asked = [what for name, what in UNSUPPORTED if getattr(args, name, None)]
    if args.mtp_num_layers and args.pipeline_model_parallel_size > 1:
        asked.append("--mtp-num-layers with pipeline parallelism")
    if asked:
        raise SystemExit(f"megatron_hyscale.launch.train_gpt does not implement {', '.join(asked)}"
                         ": run Megatron-LM's pretrain_gpt.py for that")


# --------------------------------------------------------------------------- data


# GPTDatasetConfig fields that take the Megatron argument of the same name.
_SAME_NAME_DATA_ARGS = (
    "split", "multiple_validation_sets", "full_validation", "num_dataset_builder_threads",
    "mmap_bin_files", "reset_position_ids", "reset_attention_mask", "eod_mask_loss",
    "object_storage_cache_path", "mid_level_dataset_surplus", "allow_ambiguous_pad_tokens",
    "context_parallel_size", "data_parallel_size")


def dataset_config(args: Any) -> GPTDatasetConfig:
    """GPTDatasetConfig from Megatron's arguments (the tokenizer megatron.training built)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(), create_attention_mask=args.create_attention_mask_in_dataloader,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        **{name: getattr(args, name) for name in _SAME_NAME_DATA_ARGS})


def build_datasets(train_val_test_num_samples: list[int], vp_stage: int | None = None
                   ) -> tuple[Any, Any, Any]:
    """Train / validation / test datasets; only the ranks that read batches build them."""
    args = get_args()
    kind = MockGPTDataset if args.mock_data else GPTDataset

    def built_here() -> bool:
        return (mpu.get_tensor_model_parallel_rank() == 0
                and is_first_or_last_pipeline_stage(vp_stage))

    print_rank_0(f"> building GPT datasets ({kind.__name__}) ...")
    datasets = BlendedMegatronDatasetBuilder(kind, train_val_test_num_samples, built_here,
                                             dataset_config(args)).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# megatron.training calls the provider on every rank (and lets it decide who builds)
build_datasets.is_distributed = True  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- forward step


def next_batch(data_iterator: Any, vp_stage: int | None) -> dict[str, Any]:
    """This rank's micro-batch: read on tensor-parallel rank 0, broadcast over the TP group,
    then this context-parallel rank's share of the sequence. Middle pipeline stages read
    nothing (their input comes from the previous stage)."""
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return dict.fromkeys(_BATCH_FIELDS)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict[str, Any] = {}
    if tp_rank == 0:
        read = next(data_iterator)  # only the fields the model takes (no dataset ids)
        batch = {k: (read[k].cuda(non_blocking=True) if read.get(k) is not None else None)
                 for k in _BATCH_FIELDS}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size, tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch.setdefault("cu_seqlens", None)
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                      cp_group=mpu.get_context_parallel_group())
    return {k: batch.get(k) for k in _BATCH_FIELDS}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(sum of the masked per-token losses, the token count, {'lm loss': [sum, count]}):
    megatron.training divides by the count over the data-parallel group and logs 'lm loss'."""
    mask = loss_mask.reshape(-1).float()
    loss = (output_tensor.reshape(-1).float() * mask).sum()
    tokens = mask.sum().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        checker = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            checker.validate_result(result=loss, rejection_func=reject,
                                    message=f"found {what} in local forward loss calculation",
                                    tolerance=0.0, fatal=True)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.to(loss.dtype)])}


def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """One micro-batch through the model: the per-token losses and how to reduce them."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = next_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    timers("batch-generator").stop()
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"])


def embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Ranks holding word embeddings: the first stage, and the last when the output layer
    shares them."""
    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1 and not get_args().untie_embeddings_and_output_weights:
        ranks.add(pp_ranks[-1])
    return sorted(ranks)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Parse Megatron's arguments (sys.argv, or `argv`), then megatron.training.pretrain."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    check_supported(args)
    print_rank_0(HYSCALE_TRAINER_BANNER)
    model_config = gpt_config_from_args(args)
    pretrain(pretrain_cfg_container_from_args(args, model_config), build_datasets,
             ModelType.encoder_or_decoder, forward_step, get_embedding_ranks=embedding_ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
