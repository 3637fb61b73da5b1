"""The Trainer arguments that decide a run's weights: the keys a recipe keeps (`TRAINER_ARG_KEYS`), recorded by
`GradianCallback` from the live arguments (`recorded_args`), read from a Trainer dir's training_args.bin
(`trainer_dir`) and replayed by the TRL backend (`trl.sft_arguments`)."""

from __future__ import annotations

from typing import Any

# The training arguments that decide the weights (recorded by the callback, replayed by the TRL backend).
TRAINER_ARG_KEYS = (
    "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "num_train_epochs",
    "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "weight_decay", "max_grad_norm",
    "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "optim_args", "seed", "data_seed", "full_determinism",
    "bf16", "fp16", "tf32", "gradient_checkpointing", "train_sampling_strategy", "group_by_length",
    "length_column_name", "dataloader_drop_last", "label_smoothing_factor", "neftune_noise_alpha",
    "average_tokens_across_devices", "logging_steps",
    # SFTConfig
    "max_length", "packing", "packing_strategy", "padding_free", "pad_to_multiple_of", "completion_only_loss",
    "assistant_only_loss", "loss_type", "dataset_text_field", "shuffle_dataset", "truncation_mode", "eos_token",
)


def recorded_args(args) -> dict[str, Any]:
    """The training arguments that matter, as JSON values (enums as their names)."""
    d = args.to_dict()
    out = {k: d[k] for k in TRAINER_ARG_KEYS if k in d}
    for k in out:
        if k.endswith("_token"):  # to_dict masks every *_token field (meant for hub tokens) as "<EOS_TOKEN>"
            out[k] = getattr(args, k, None)
    return out
