"""AdamW with warmup + cosine decay and global-norm clipping (optax)."""

import jax
import optax

from pretrain.config import OptimizerConfig


def learning_rate(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to lr, then cosine decay to min_lr_ratio · lr at total_steps."""
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=config.lr * config.min_lr_ratio,
    )


def applied_updates(opt_state) -> jax.Array:
    """How many updates `make_optimizer`'s state has applied: the LR schedule's position, which
    skipped (non-finite) steps do not advance."""

    def is_schedule(x) -> bool:
        return isinstance(x, optax.ScaleByScheduleState)

    (schedule,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(x)]
    return schedule.count


def make_optimizer(
    config: OptimizerConfig, total_steps: int, param_axes: dict
) -> optax.GradientTransformation:
    """param_axes: the logical axes tree of the params; norm offsets (axis "norm") get no decay."""
    decay_mask = jax.tree.map(
        lambda axes: axes[-1] != "norm", param_axes, is_leaf=lambda x: isinstance(x, tuple)
    )
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            learning_rate(config, total_steps),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=decay_mask,
        ),
    )
