# %% [markdown]
# # 02 · Optimizer: the learning-rate and weight-decay schedule
#
# `OptimizerParamScheduler` with Megatron's constructor arguments and semantics: counted in
# **samples**, a linear warmup, then constant / linear / cosine / inverse-square-root / WSD
# decay, a weight-decay increment schedule, and a state dict whose reload obeys the
# override / use-checkpoint rules.

# %%
from __future__ import annotations

import math

from tinytron.optimizer._checks import (LR_DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES,
                                        check_scheduler)

__all__ = ["OptimizerParamScheduler", "LR_DECAY_STYLES", "WSD_DECAY_STYLES", "WD_INCR_STYLES"]

# %% [markdown]
# ## The schedule, in samples
#
# Megatron's scheduler (`megatron/core/optimizer_param_scheduler.py:100`) counts **samples**, not
# iterations: after every successful iteration `train_step` calls `step(increment=dp·mbs·M)`
# (= the global batch size), and the iteration-based command-line lengths are converted by
# multiplying with the global batch size (`lr_decay_steps = lr_decay_iters · gbs`,
# `lr_warmup_steps = lr_warmup_iters · gbs` or `lr_warmup_fraction · lr_decay_steps`,
# `wd_incr_steps = train_iters · gbs`; `megatron/training/training.py:1827-1880`). A skipped
# iteration (loss-scale overflow) does not step the scheduler.
#
# With $n$ = `num_steps`, $W$ = `lr_warmup_steps`, $D$ = `lr_decay_steps` (`get_lr`, `:218`):
#
# 1. warmup, if $W > 0$ and $n \le W$: $\;\text{lr} = \text{init} + (\text{max} - \text{init})\, n/W$;
# 2. `constant`: max;  $n > D$: min;
# 3. `inverse-square-root`: $\max(\text{min},\ \text{max}\sqrt{\max(W,1)}/\sqrt{\max(n,1)})$;
# 4. otherwise with $r = (n-W)/(D-W)$: $\text{lr} = \text{min} + c\,(\text{max}-\text{min})$ where
#    `linear` $c = 1-r$, `cosine` $c = \tfrac12(\cos\pi r + 1)$, and `WSD` $c = 1$ until
#    $D - S$ ($S$ = `wsd_decay_steps`) and then, with $r' = (n - (D-S))/S$, `linear` $1-r'$,
#    `cosine` $\tfrac12(\cos\pi r'+1)$, `exponential` $2\cdot 0.5^{r'} - 1$, `minus_sqrt`
#    $1-\sqrt{r'}$.
#
# `max_lr` / `min_lr` come from the param group when it has them (decoupled embedding lr), the
# warmup's `init_lr` is global. Weight decay (`get_wd`, `:184`): `constant` (start must equal
# end), `linear` $s + r(e-s)$ or `cosine` $s + \tfrac12(\cos(\pi(1-r))+1)(e-s)$ with
# $r = n/$`wd_incr_steps`, and `end_wd` after; each group gets `weight_decay = wd · wd_mult`
# (so norms and biases with `wd_mult=0` stay at 0). Empty groups are set too.
#
# Worked example: `max_lr=1e-3, min_lr=1e-4, W=100, D=1000`, cosine. At $n=50$: $5\cdot10^{-4}$.
# At $n=550$: $r=0.5$, $c=0.5$, lr $= 10^{-4} + 0.5 \cdot 9\cdot10^{-4} = 5.5\cdot10^{-4}$. At
# $n=1001$: $10^{-4}$.
#
# ```mermaid
# flowchart LR
#   A{"W>0 and n≤W?"} -- yes --> W[linear warmup]
#   A -- no --> B{constant?} -- yes --> M[max_lr]
#   B -- no --> C{"n>D?"} -- yes --> m[min_lr]
#   C -- no --> S[decay style: linear / cosine / inv-sqrt / WSD]
# ```

# %%
def _wsd_coeff(n: float, decay_steps: float, wsd_steps: float, style: str) -> float:
    """The WSD multiplier: 1 during the stable phase, then the chosen anneal."""
    start = decay_steps - wsd_steps
    if n <= start:
        return 1.0
    r = float(n - start) / float(wsd_steps)
    if style == "linear":
        return 1.0 - r
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * r) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, r) - 1.0
    return 1.0 - math.sqrt(r)  # minus_sqrt


# %% [markdown]
# The two schedules above as code. Both are pure functions of `num_steps` and the
# constructor's values (and a group's own `max_lr`, `min_lr`, `start_wd`, `end_wd` when it has
# them), which is what makes a resumed run's schedule exact: restoring one integer restores
# every learning rate.

# %%
class Schedules:
    """Mixin for OptimizerParamScheduler: lr and weight decay at the current sample count."""

    def get_wd(self, param_group: dict | None = None) -> float:
        """Weight decay at the current sample count (group start_wd/end_wd take precedence)."""
        group = param_group or {}
        start, end = group.get("start_wd", self.start_wd), group.get("end_wd", self.end_wd)
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return end
        r = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = r
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - r)) + 1.0)
        return start + coeff * (end - start)

    def get_lr(self, param_group: dict) -> float:
        """Learning rate at the current sample count for one param group."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        n, warm, decay = self.num_steps, self.lr_warmup_steps, self.lr_decay_steps
        if warm > 0 and n <= warm:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(warm)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > decay:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(warm, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = float(n - warm) / float(decay - warm)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = _wsd_coeff(n, decay, self.wsd_decay_steps, self.lr_wsd_decay_style)
        return min_lr + coeff * (max_lr - min_lr)


# %% [markdown]
# ## state_dict and the reload rules
#
# The checkpoint holds ten values. On reload each hyperparameter goes through one rule
# (`_check_and_set`, `:318`): with `override_opt_param_scheduler` the value given to the
# constructor wins; otherwise, if not `use_checkpoint_opt_param_scheduler`, constructor and
# checkpoint must agree; otherwise the checkpoint's value is used. Then `step(num_steps)` puts
# the scheduler back at the saved position. Older checkpoints used other key names (`start_lr`,
# `warmup_iter`/`warmup_steps`, `end_iter`/`decay_steps`, `decay_style`, `num_iters`), still
# accepted. As in Megatron, the step comes *before* the weight-decay fields are restored, so
# the weight decay it writes into the groups is computed from the constructor's values; the
# next `step()` uses the restored ones.
#
# <details><summary>Megatron detail: an error instead of an assert</summary>
#
# Where constructor and checkpoint disagree without either flag, Megatron asserts; tinytron
# raises a `ValueError` that names the field and both values, and says which flag to set.
#
# </details>
#
# Worked example: a run saved at `num_steps = 4096` with `max_lr = 3e-4` is resumed with
# `max_lr = 1e-4` on the command line. By default (`use_checkpoint_opt_param_scheduler`) the
# resumed run keeps 3e-4; with `override_opt_param_scheduler` it switches to 1e-4 at the
# saved position; with neither it stops with the error.
#
# First the ten names themselves, and a reader for checkpoints that stored a value under an
# older name.

# %%
_SAVED_KEYS = ("max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps",
               "min_lr", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps")


def _pick(sd: dict, *keys):
    """The value of the first of `keys` that `sd` holds (old checkpoints use old names)."""
    return next(sd[k] for k in keys if k in sd)


# %% [markdown]
# The mixin: `state_dict` saves the ten values, `_check_and_set` is the rule for one field, and
# `load_state_dict` applies it field by field before stepping to the saved position.

# %%
class ReloadRules:
    """Mixin for OptimizerParamScheduler: the ten saved values and Megatron's reload policy."""

    def state_dict(self) -> dict:
        """The ten values a checkpoint keeps."""
        return {k: getattr(self, k) for k in _SAVED_KEYS}

    def _check_and_set(self, cls_value, sd_value, name: str):
        """Megatron's reload policy for one hyperparameter."""
        if self.override_opt_param_scheduler:
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(f"OptimizerParamScheduler: {name} is {cls_value} here but "
                             f"{sd_value} in the checkpoint (set override_opt_param_scheduler "
                             f"or use_checkpoint_opt_param_scheduler)")
        return sd_value

    def load_state_dict(self, sd: dict) -> None:
        """Restore from a checkpoint (legacy key names accepted) and step to its position."""
        self.max_lr = self._check_and_set(self.max_lr, _pick(sd, "start_lr", "max_lr"), "max_lr")
        self.min_lr = self._check_and_set(self.min_lr, sd["min_lr"], "min_lr")
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps, _pick(sd, "warmup_iter", "warmup_steps", "lr_warmup_steps"),
            "lr_warmup_steps")
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps, _pick(sd, "end_iter", "decay_steps", "lr_decay_steps"),
            "lr_decay_steps")
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style, _pick(sd, "decay_style", "lr_decay_style"), "lr_decay_style")
        # Megatron's order (optimizer_param_scheduler.py, load_state_dict): step by the saved
        # count *without* resetting num_steps (a fresh scheduler is at 0), then the wd fields
        self.step(_pick(sd, "num_iters", "num_steps"))
        if "start_wd" in sd:
            for key in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"):
                setattr(self, key, self._check_and_set(getattr(self, key), sd[key], key))


# %% [markdown]
# ## The scheduler
#
# It is constructed with every length already in samples (the factory converts iterations),
# checks that the lengths and rates are consistent (the checks, with the style names, are in
# the chapter's private module `tinytron.optimizer._checks`), and sets the groups' first
# values. `step` is what the training loop calls with the number of samples consumed; it writes
# the new values into every param group (a group's `wd_mult` of 0 keeps norms and biases
# undecayed).

# %%
class OptimizerParamScheduler(Schedules, ReloadRules):
    """Warmup + decay of the learning rate and an increment schedule for weight decay, in samples."""

    def __init__(self, optimizer, init_lr: float, max_lr: float, min_lr: float,
                 lr_warmup_steps: int, lr_decay_steps: int, lr_decay_style: str,
                 start_wd: float, end_wd: float, wd_incr_steps: int, wd_incr_style: str,
                 use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False,
                 wsd_decay_steps: int | None = None, lr_wsd_decay_style: str | None = None):
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = init_lr, float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        check_scheduler(self)  # one-line ValueErrors naming the argument (_checks.py)
        self.step(0)

    def step(self, increment: int) -> None:
        """Advance by `increment` samples and write lr / weight_decay into every group."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)


# %% [markdown]
# ## Demo: every decay style, and the weight-decay ramps
#
# One optimizer-like object with two groups: the default one and a "decoupled" embedding group
# with its own `max_lr`/`min_lr`; a norm group with `wd_mult=0`. Sample counts as in a run with
# global batch 8: warmup 10 iterations, decay over 100. Note the cliff of
# `inverse-square-root` at the end of the decay: past `lr_decay_steps` every style returns
# `min_lr` (rule 2 comes before rule 3), even though $1/\sqrt n$ has not reached it yet.

# %%
class _Groups:
    """The smallest thing the scheduler can drive: an object with param_groups."""

    def __init__(self, groups: list[dict]):
        self.param_groups = groups


def _trace(sched: OptimizerParamScheduler, total: int, increment: int) -> tuple[list, list]:
    """Sample counts and the first group's lr after each step."""
    xs, lrs = [sched.num_steps], [sched.optimizer.param_groups[0]["lr"]]
    while sched.num_steps < total:
        sched.step(increment)
        xs.append(sched.num_steps)
        lrs.append(sched.optimizer.param_groups[0]["lr"])
    return xs, lrs


# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    gbs, warm, decay = 8, 10 * 8, 100 * 8
    common = dict(init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=warm,
                  lr_decay_steps=decay, start_wd=0.1, end_wd=0.1, wd_incr_steps=decay,
                  wd_incr_style="constant")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    for style in LR_DECAY_STYLES:
        extra = dict(wsd_decay_steps=30 * 8, lr_wsd_decay_style="cosine") if style == "WSD" else {}
        s = OptimizerParamScheduler(_Groups([{}]), lr_decay_style=style, **common, **extra)
        axes[0].plot(*_trace(s, 120 * gbs, gbs), label=style)
    for wsd in WSD_DECAY_STYLES:
        s = OptimizerParamScheduler(_Groups([{}]), lr_decay_style="WSD", wsd_decay_steps=30 * 8,
                                    lr_wsd_decay_style=wsd, **common)
        axes[1].plot(*_trace(s, 110 * gbs, gbs), label=f"WSD {wsd}")
    for wd_style in ("linear", "cosine"):
        groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0}]
        s = OptimizerParamScheduler(_Groups(groups), lr_decay_style="linear",
                                    **dict(common, start_wd=0.0, end_wd=0.1, wd_incr_style=wd_style))
        xs, wds = [0], [groups[0]["weight_decay"]]
        while s.num_steps < 110 * gbs:
            s.step(gbs)
            xs.append(s.num_steps)
            wds.append(groups[0]["weight_decay"])
        axes[2].plot(xs, wds, label=f"wd {wd_style}")
        assert groups[1]["weight_decay"] == 0.0   # wd_mult=0 groups never decay
    for ax, title in zip(axes, ["lr decay styles", "WSD anneals", "weight-decay increment"]):
        ax.set(title=title, xlabel="samples")
        ax.legend(fontsize=7)
    plt.tight_layout()
    plt.show()

# %% [markdown]
# The worked example in numbers: warmup 100 samples, cosine decay to 1000, and a decoupled group
# that peaks at 2e-3 and decays to 0.

# %%
if __name__ == "__main__":
    groups = [{}, {"max_lr": 2e-3, "min_lr": 0.0}]
    s = OptimizerParamScheduler(_Groups(groups), 0.0, 1e-3, 1e-4, 100, 1000, "cosine",
                                0.0, 0.0, 1000, "constant")
    values = {}
    for n in (50, 550, 1001):
        s.step(n - s.num_steps)
        values[n] = (groups[0]["lr"], groups[1]["lr"])
        print(f"n={n:5d}: lr={groups[0]['lr']:.2e}  decoupled group lr={groups[1]['lr']:.2e}")
    assert math.isclose(values[50][0], 5e-4) and math.isclose(values[550][0], 5.5e-4)
    assert values[1001] == (1e-4, 0.0) and math.isclose(values[550][1], 1e-3)

# %% [markdown]
# Save at $n = 1001$ and reload into a fresh scheduler: it comes back at the same position with
# the same learning rate.

# %%
if __name__ == "__main__":
    fresh = OptimizerParamScheduler(_Groups([{}, {"max_lr": 2e-3, "min_lr": 0.0}]), 0.0, 1e-3, 1e-4,
                                    100, 1000, "cosine", 0.0, 0.0, 1000, "constant")
    fresh.load_state_dict(s.state_dict())
    assert fresh.num_steps == 1001 and fresh.optimizer.param_groups[0]["lr"] == 1e-4

# %% [markdown]
# ## Summary
#
# - The schedule is a pure function of the sample count `num_steps`; `step(gbs)` after every
#   successful iteration moves it, a skipped iteration does not.
# - Groups carry their own `max_lr`/`min_lr` and `wd_mult`, so one scheduler drives decoupled
#   embedding learning rates and no-decay groups.
# - Reload: the checkpoint's ten values, checked or overridden field by field, then one `step`.
#
# ## How production does it
#
# - Megatron: `megatron/core/optimizer_param_scheduler.py` (`get_wd:184`, `get_lr:218`,
#   `step:284`, `state_dict:302`, `_check_and_set:318`, `load_state_dict:341`); construction
#   in `megatron/training/training.py:1827-1880` (`get_optimizer_param_scheduler`).
# - torchtitan: `torchtitan/components/lr_scheduler.py` (warmup-stable-decay as a
#   `LambdaLR` multiplier, counted in steps).
#
# ## Exercises
#
# 1. Megatron counts samples. What goes wrong in an iteration-counted schedule if the global
#    batch size is ramped up during training (`--rampup-batch-size`)?
#
#    <details><summary>Hint</summary>
#
#    `step(increment)` adds the samples of one iteration to
#    `num_steps`. During a ramp an early iteration holds fewer samples than a late one: count
#    how many samples an iteration-counted warmup of $W$ iterations really spans.
#
#    </details>
#
# 2. With `inverse-square-root`, at which sample count does the lr reach `min_lr` for
#    `max_lr=1e-3, min_lr=1e-4, W=800`? Check with the class.
#
#    <details><summary>Answer</summary>
#
#    $10^{-3}\sqrt{800/n} = 10^{-4}$ gives $n = 800 \cdot 100
#    = 80{,}000$. With `lr_decay_steps` $\ge$ 80,000 the class returns $1.0000063 \cdot 10^{-4}$ at
#    $n$ = 79,999 and exactly `min_lr` from 80,000 on. A shorter `lr_decay_steps` reaches `min_lr`
#    earlier, at its cliff.
#
#    </details>
#
# 3. Why must a WSD run be able to *change* `lr_decay_steps` on resume (think of deciding late
#    when to anneal), and which flag allows it?
#
#    <details><summary>Hint</summary>
#
#    Follow `lr_decay_steps` through `ReloadRules.load_state_dict`
#    and `_check_and_set`: which of the two flags lets the constructor's value win over the
#    checkpoint's?
#
#    </details>
