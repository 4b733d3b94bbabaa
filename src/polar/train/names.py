"""polar's training-config names next to TRL's and verl's, so a recipe moves between them.

One row per `TrainConfig` field (a test checks that every field has one and that every TRL name is a field
of `trl.GRPOConfig`). `names` are the other framework's config keys that carry the setting; empty means it
has no equivalent, and `note` says what differs or where the setting lives instead. Never a guessed name:

- TRL: `trl.GRPOConfig` of TRL 1.16.0 (its own fields and those inherited from transformers 5.24
  `TrainingArguments`), read from the installed `trl/trainer/grpo_config.py`.
- verl: verl-project/verl `verl/trainer/config/_generated_ppo_trainer.yaml` at commit 1a7e2cab (the
  flattened config of `main_ppo`, GRPO included), `verl/workers/config/optimizer.py` at 567db268 and
  `verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml` at d23b2829 (async training).

`polar.docs` renders the table (docs/reference/names.md); `polar train --set` uses it to point a TRL or verl
name typed by habit at polar's (`--set learning_rate=...` -> "did you mean optimizer.lr?").
"""

from __future__ import annotations

from dataclasses import dataclass

TRL_SOURCE = "version 1.16.0, `trl.GRPOConfig` (with the fields it inherits from transformers 5.24 `TrainingArguments`)"
VERL_SOURCE = (
    "the verl-project/verl repository, `verl/trainer/config/_generated_ppo_trainer.yaml` at commit `1a7e2cab`, "
    "`verl/workers/config/optimizer.py` at `567db268`, and for asynchronous training "
    "`verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml` at `d23b2829`"
)


@dataclass(frozen=True, slots=True)
class Equivalent:
    """The other framework's keys for one polar setting (empty: none) and what differs."""

    names: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True, slots=True)
class NameRow:
    polar: str  # dotted TrainConfig path
    trl: Equivalent
    verl: Equivalent


NONE = Equivalent()
DAPO = "verl's DAPO recipe (its launch scripts set it), not `main_ppo`"

NAMES: tuple[NameRow, ...] = (
    NameRow(
        "model",
        Equivalent(note="the `model` argument of `GRPOTrainer`, not a config field"),
        Equivalent(("actor_rollout_ref.model.path",)),
    ),
    NameRow(
        "tasks",
        Equivalent(note="the `train_dataset` argument of `GRPOTrainer` (prompts), not a config field"),
        Equivalent(("data.train_files",), "prompts in Parquet; polar runs tasks through a harness instead"),
    ),
    NameRow("group_size", Equivalent(("num_generations",)), Equivalent(("actor_rollout_ref.rollout.n",))),
    NameRow(
        "batch_groups",
        Equivalent(
            ("generation_batch_size",),
            "counts completions: `batch_groups` x `group_size`; TRL processes one generation batch per "
            "optimizer step by default",
        ),
        Equivalent(
            ("data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"),
            "prompts per step; polar takes one optimizer step per batch, as verl does when both are equal",
        ),
    ),
    NameRow("steps", Equivalent(("max_steps",)), Equivalent(("trainer.total_training_steps",))),
    NameRow(
        "max_staleness",
        Equivalent(
            note="`GRPOTrainer` is synchronous; TRL's experimental `AsyncGRPOConfig.max_staleness` counts "
            "weight updates like polar's"
        ),
        Equivalent(
            note="the experimental fully-async trainer's `async_training.staleness_threshold` is a fraction "
            "of a batch that may be stale, not a version count"
        ),
    ),
    NameRow(
        "pace",
        Equivalent(note="none: `GRPOTrainer` generates each batch with the current policy"),
        Equivalent(
            note="the fully-async trainer bounds its stale samples by `async_training.staleness_threshold` "
            "(a fraction of a batch); no on/off switch"
        ),
    ),
    NameRow(
        "max_in_flight",
        Equivalent(note="experimental `AsyncGRPOConfig.max_inflight_tasks` counts generation requests"),
        NONE,
    ),
    NameRow(
        "estimator",
        Equivalent(
            ("scale_rewards",),
            '`grpo` = `"group"`, `dr_grpo` = `"none"`; `rloo` is TRL\'s separate `RLOOTrainer`',
        ),
        Equivalent(
            ("algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo"),
            "`grpo` = `grpo`, `rloo` = `rloo`, `dr_grpo` = `grpo` with `norm_adv_by_std_in_grpo: false`",
        ),
    ),
    NameRow(
        "filter.zero_variance",
        Equivalent(note="none: TRL trains on every group (a zero-variance group has advantage 0)"),
        Equivalent(("algorithm.filter_groups.enable",), f"{DAPO}, with `algorithm.filter_groups.metric`"),
    ),
    NameRow(
        "filter.all_masked",
        Equivalent(note="none: TRL has no masked sessions"),
        Equivalent(note="none: verl's rollouts have no masked (infrastructure-failed) sessions"),
    ),
    NameRow(
        "filter.max_groups_per_step",
        NONE,
        Equivalent(
            ("algorithm.filter_groups.max_num_gen_batches",),
            f"{DAPO}; counts generation batches (0: no cap) and stops with an error past it, where polar "
            "fills the batch with the groups it left out",
        ),
    ),
    NameRow(
        "overlong.mode",
        Equivalent(("mask_truncated_completions",), "`true` is polar's `mask`; TRL has no length penalty"),
        Equivalent(("reward_model.overlong_buffer.enable",), f"`true` is polar's `penalty`; {DAPO}"),
    ),
    NameRow(
        "overlong.max_tokens",
        Equivalent(("max_completion_length",), "TRL's limit on a completion, not a penalty setting"),
        Equivalent(("data.max_response_length",), "the DAPO reward manager's `max_resp_len`"),
    ),
    NameRow(
        "overlong.buffer",
        NONE,
        Equivalent(("reward_model.overlong_buffer.len",), DAPO),
    ),
    NameRow(
        "overlong.penalty_factor",
        NONE,
        Equivalent(("reward_model.overlong_buffer.penalty_factor",), DAPO),
    ),
    NameRow(
        "eval.tasks",
        Equivalent(note="the `eval_dataset` argument of `GRPOTrainer` (prompts), not a config field"),
        Equivalent(("data.val_files",), "prompts in Parquet"),
    ),
    NameRow(
        "eval.every",
        Equivalent(("eval_steps",), 'with `eval_strategy: "steps"`'),
        Equivalent(("trainer.test_freq",)),
    ),
    NameRow(
        "eval.samples",
        Equivalent(("num_generations_eval",)),
        Equivalent(("actor_rollout_ref.rollout.val_kwargs.n",)),
    ),
    NameRow(
        "eval.before_training", Equivalent(("eval_on_start",)), Equivalent(("trainer.val_before_train",))
    ),
    NameRow("pass_threshold", Equivalent(note="polar uses it for the `pass_rate` metric only"), NONE),
    NameRow(
        "temperature", Equivalent(("temperature",)), Equivalent(("actor_rollout_ref.rollout.temperature",))
    ),
    NameRow(
        "loss.eps_low", Equivalent(("epsilon",)), Equivalent(("actor_rollout_ref.actor.clip_ratio_low",))
    ),
    NameRow(
        "loss.eps_high",
        Equivalent(("epsilon_high",)),
        Equivalent(("actor_rollout_ref.actor.clip_ratio_high",)),
    ),
    NameRow(
        "loss.tis_cap",
        Equivalent(
            ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_mode", "use_vllm"),
            'polar\'s per-token cap is mode `"token_truncate"`; TRL applies it only with `use_vllm`',
        ),
        Equivalent(
            ("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_correction.rollout_is"),
            "`rollout_is: token` for a per-token weight",
        ),
    ),
    NameRow(
        "loss.kl_coef",
        Equivalent(("beta",), "k3 estimator, as polar's"),
        Equivalent(
            (
                "actor_rollout_ref.actor.kl_loss_coef",
                "actor_rollout_ref.actor.use_kl_loss",
                "actor_rollout_ref.actor.kl_loss_type",
            ),
            "with `use_kl_loss: true`; `kl_loss_type: low_var_kl` is k3",
        ),
    ),
    NameRow(
        "loss.aggregation",
        Equivalent(
            ("loss_type",),
            '`token_mean` = `"dapo"` (tokens of the whole batch); `sequence_mean` is closest to `"grpo"`, '
            "which does not weight traces by trajectory",
        ),
        Equivalent(
            ("actor_rollout_ref.actor.loss_agg_mode",),
            "`token_mean` = `token-mean`; `sequence_mean` is closest to `seq-mean-token-mean`, without "
            "per-trajectory weights",
        ),
    ),
    NameRow(
        "optimizer.lr", Equivalent(("learning_rate",)), Equivalent(("actor_rollout_ref.actor.optim.lr",))
    ),
    NameRow(
        "optimizer.schedule",
        Equivalent(("lr_scheduler_type",), "TRL's default is `linear`, polar's `constant`"),
        Equivalent(
            ("actor_rollout_ref.actor.optim.lr_scheduler_type", "actor_rollout_ref.actor.optim.warmup_style"),
            "`constant` or `cosine` (the older releases' key is `warmup_style`)",
        ),
    ),
    NameRow(
        "optimizer.warmup_steps",
        Equivalent(("warmup_steps",)),
        Equivalent(("actor_rollout_ref.actor.optim.lr_warmup_steps",)),
    ),
    NameRow(
        "optimizer.min_lr_ratio",
        Equivalent(
            ("lr_scheduler_kwargs",), '`{"min_lr_rate": ...}` with `lr_scheduler_type: cosine_with_min_lr`'
        ),
        Equivalent(("actor_rollout_ref.actor.optim.min_lr_ratio",)),
    ),
    NameRow(
        "optimizer.weight_decay",
        Equivalent(("weight_decay",), "TRL's default is 0.0, polar's 0.1"),
        Equivalent(("actor_rollout_ref.actor.optim.weight_decay",), "verl's default is 0.01"),
    ),
    NameRow(
        "optimizer.betas",
        Equivalent(("adam_beta1", "adam_beta2")),
        Equivalent(("actor_rollout_ref.actor.optim.betas",)),
    ),
    NameRow(
        "optimizer.eps",
        Equivalent(("adam_epsilon",)),
        Equivalent(
            ("actor_rollout_ref.actor.optim.override_optimizer_config",),
            "no key of its own: `{eps: ...}` here is passed to the optimizer",
        ),
    ),
    NameRow(
        "optimizer.grad_clip",
        Equivalent(("max_grad_norm",)),
        Equivalent(
            ("actor_rollout_ref.actor.grad_clip", "actor_rollout_ref.actor.optim.clip_grad"),
            "the FSDP actor's key, and the optimizer config's",
        ),
    ),
    NameRow(
        "lora.r",
        Equivalent(
            note="TRL takes a `peft.LoraConfig` as `GRPOTrainer(peft_config=...)`, not a `GRPOConfig` field (`r`)"
        ),
        Equivalent(("actor_rollout_ref.model.lora_rank",), "0 turns LoRA off (key read at commit 01d4d766)"),
    ),
    NameRow(
        "lora.alpha",
        Equivalent(
            note="TRL takes a `peft.LoraConfig` as `GRPOTrainer(peft_config=...)`, not a `GRPOConfig` field (`lora_alpha`)"
        ),
        Equivalent(("actor_rollout_ref.model.lora_alpha",), "key read at commit 01d4d766"),
    ),
    NameRow(
        "lora.dropout",
        Equivalent(
            note="TRL takes a `peft.LoraConfig` as `GRPOTrainer(peft_config=...)`, not a `GRPOConfig` field (`lora_dropout`)"
        ),
        Equivalent(
            note="none on the FSDP path; the Megatron path has `actor_rollout_ref.model.lora.dropout`"
        ),
    ),
    NameRow(
        "lora.target_modules",
        Equivalent(
            note="TRL takes a `peft.LoraConfig` as `GRPOTrainer(peft_config=...)`, not a `GRPOConfig` field (`target_modules`)"
        ),
        Equivalent(("actor_rollout_ref.model.target_modules",), "same values (`all-linear` or names)"),
    ),
    NameRow(
        "lora.sync",
        Equivalent(note="no key of its own"),
        Equivalent(note="no key of its own"),
    ),
    NameRow(
        "lora.adapter_name",
        Equivalent(note="no key of its own"),
        Equivalent(note="no key of its own"),
    ),
    NameRow(
        "micro_batch_tokens",
        Equivalent(note="`GRPOConfig` batches by completions (`per_device_train_batch_size`), not tokens"),
        Equivalent(
            ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.actor.use_dynamic_bsz"),
            "with `use_dynamic_bsz: true`",
        ),
    ),
    NameRow(
        "grad_accum",
        Equivalent(("gradient_accumulation_steps",), "exact in TRL; a minimum in polar"),
        Equivalent(note="follows from `ppo_mini_batch_size` and `ppo_micro_batch_size_per_gpu`"),
    ),
    NameRow(
        "gradient_checkpointing",
        Equivalent(
            ("gradient_checkpointing",),
            "TRL's default is on; transformers 5 also names it `activation_checkpointing`",
        ),
        Equivalent(("actor_rollout_ref.model.enable_gradient_checkpointing",)),
    ),
    NameRow(
        "dtype",
        Equivalent(("bf16",), "`bf16=True` = `bfloat16`"),
        Equivalent(("actor_rollout_ref.actor.fsdp_config.dtype",), "mixed-precision dtype; weights fp32"),
    ),
    NameRow("device", Equivalent(("use_cpu",)), Equivalent(("trainer.device",))),
    NameRow(
        "parallel",
        Equivalent(("fsdp",), "or `accelerate launch --use_fsdp`; DDP is what accelerate does without it"),
        Equivalent(("actor_rollout_ref.actor.strategy",), "`fsdp2` = `fsdp`; verl has no DDP"),
    ),
    NameRow(
        "dist_timeout_s",
        Equivalent(("ddp_timeout",), "default 1800 s"),
        Equivalent(("actor_rollout_ref.nccl_timeout",), "default 600 s"),
    ),
    NameRow(
        "seed",
        Equivalent(("seed",)),
        Equivalent(note="one per component, e.g. `data.seed`, `actor_rollout_ref.actor.fsdp_config.seed`"),
    ),
    NameRow(
        "shuffle",
        Equivalent(("data_seed",), "no switch: the Trainer's sampler always shuffles, seeded by `data_seed`"),
        Equivalent(("data.shuffle",), "`data.seed` seeds it"),
    ),
    NameRow("out", Equivalent(("output_dir",)), Equivalent(("trainer.default_local_dir",))),
    NameRow(
        "checkpoint_every",
        Equivalent(("save_steps", "save_strategy"), 'with `save_strategy="steps"`'),
        Equivalent(("trainer.save_freq",)),
    ),
    NameRow(
        "resume",
        Equivalent(
            ("resume_from_checkpoint",),
            "not read by the trainer itself: pass it to `trainer.train(resume_from_checkpoint=...)`",
        ),
        Equivalent(("trainer.resume_from_path", "trainer.resume_mode"), "with `resume_mode: resume_path`"),
    ),
    NameRow(
        "backend",
        Equivalent(
            ("vllm_server_base_url", "use_vllm", "vllm_mode"),
            'a vLLM server with `use_vllm=True`, `vllm_mode="server"`',
        ),
        Equivalent(note="verl starts its own rollout engines (`actor_rollout_ref.rollout.name`)"),
    ),
    NameRow("served_model", NONE, NONE),
    NameRow("render", NONE, NONE),
    NameRow("capacity", Equivalent(note="TRL generates in-process; no harness sessions"), NONE),
    NameRow("allow_callback", NONE, NONE),
    NameRow("drain_timeout_s", NONE, NONE),
    NameRow("verify_weight_sync", NONE, NONE),
    NameRow(
        "metrics.tensorboard",
        Equivalent(("report_to",), '`report_to=["tensorboard"]`'),
        Equivalent(("trainer.logger",), '`logger: ["console", "tensorboard"]`'),
    ),
    NameRow(
        "metrics.wandb",
        Equivalent(("report_to",), '`report_to=["wandb"]`'),
        Equivalent(("trainer.logger",), '`logger: ["console", "wandb"]`'),
    ),
    NameRow(
        "metrics.wandb_project",
        Equivalent(note="W&B reads the `WANDB_PROJECT` environment variable; TRL's `project` is Trackio's"),
        Equivalent(("trainer.project_name",)),
    ),
    NameRow("metrics.run_name", Equivalent(("run_name",)), Equivalent(("trainer.experiment_name",))),
)


def polar_name_for(other: str) -> str | None:
    """polar's field for a TRL or verl config key (`learning_rate` -> `optimizer.lr`), or None. A key shared
    by several rows (`report_to`) maps to the first."""
    for row in NAMES:
        if other in row.trl.names or other in row.verl.names:
            return row.polar
    return None
