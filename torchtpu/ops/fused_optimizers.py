"""The fused optimizer steps: what `torch.optim.{Adam,AdamW,SGD,Adagrad}(fused=True)` call.

`_fused_adam`, `_fused_adamw`, `_fused_sgd` and `_fused_adagrad` update every parameter of a
param group, with its gradient and optimizer state, in ONE program on the device instead of
copying them all to the host and back each step. Each lowering computes what PyTorch's CPU
kernels compute (aten/src/ATen/native/cpu/Fused{Adam,SGD,Adagrad}Kernel.cpp), in their order
of operations:

- Elements in "opmath" (float32 for bfloat16 and float16 tensors, else the tensor's dtype),
  rounded to the tensor's dtype once, when stored. The Python floats (lr, betas, eps, ...) are
  C++ doubles: what the kernels derive from them (bias corrections, step size, `1 - lr * wd`,
  Adagrad's decayed lr) is computed in float64 and rounded to opmath once, as there.
- A step's count is read from `state_steps` as a float32 (the optimizer has already counted
  the step); `grad_scale` divides the gradients, which are written back unscaled; a
  `found_inf` of exactly 1 leaves every tensor as it was (the kernels return before touching
  them).

XLA:CPU rounds two kinds of operations otherwise than the compiled kernels, so float32 results
can differ from theirs in the last bits: it fuses `a * b + c` into one multiply-add where it
chooses (everywhere at its default optimisation, nowhere at level 0), the kernels where they
chose (`vec::fmadd`, GCC's contraction); and it divides by a scalar by multiplying with its
reciprocal.

Two rules of the CPU kernels' bfloat16/float16 vector loops are bugs this does not copy: the
SGD loop never stores the parameters and reads the momentum buffers as float32 memory (pytorch
issue 191763); it and the Adagrad loop round `weight_decay`, `momentum`, `eps` and the lr to
the parameter's dtype before widening them. Both follow their kernels' scalar loops instead,
which compute in opmath throughout, as the Adam kernel does in both loops.

PyTorch has no meta kernel for most in-place forms of these ops; `meta_kernels` gives them one.
The checks the CPU kernels make beyond it (list lengths, dtypes, one-element steps and lr) are
the `validate` functions.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import torch

from torchtpu import dtypes
from torchtpu.ops import pointwise, reduction, registry

aten = torch.ops.aten

Array = jax.Array
Tensors = Sequence[Array]

# --- the CPU kernels' checks ------------------------------------------------------------------


def _expected(condition: str) -> str:
    """The message of a failed `TORCH_CHECK(condition)` without a message of its own."""
    return (f"Expected {condition} to be true, but got false.  (Could this error message be improved?  "
            f"If so, please report an enhancement request to PyTorch.)")


def _check_lengths(n_tensors: int, **lists: Sequence) -> None:
    for name, values in lists.items():
        if len(values) != n_tensors:
            raise RuntimeError(_expected(f"{name}.size() == n_tensors"))


def _check_optional_list(name: str, values: Sequence, n_tensors: int, used: bool) -> None:
    """A list that holds one tensor per parameter if `used`, else none."""
    if used:
        _check_lengths(n_tensors, **{name: values})
    elif values:
        raise RuntimeError(_expected(f"{name}.empty()"))


def _check_item(t: torch.Tensor) -> None:
    """`t.item()` (a step count, a tensor lr) needs one element."""
    if t.numel() != 1:
        raise RuntimeError(f"a Tensor with {t.numel()} elements cannot be converted to Scalar")


def _check_scalar_type(expected: torch.dtype, *tensors: torch.Tensor) -> None:
    """The kernels read each tensor through `data_ptr<scalar_t>()`."""
    for t in tensors:
        if t.dtype != expected:
            raise RuntimeError(f"expected scalar type {dtypes.aten_name(expected)} "
                               f"but found {dtypes.aten_name(t.dtype)}")


def _check_param(kernel: str, param: torch.Tensor) -> None:
    if param.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise NotImplementedError(f'"{kernel}" not implemented for \'{dtypes.aten_name(param.dtype)}\'')


def _check_common(lr, grad_scale, found_inf) -> None:
    """The checks before any list is looked at: a tensor lr's `item()`, then the float32
    `grad_scale` and `found_inf` pointers."""
    if isinstance(lr, torch.Tensor):
        _check_item(lr)
    _check_scalar_type(torch.float32, *(t for t in (grad_scale, found_inf) if t is not None))


def _check_adam(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, amsgrad,
                grad_scale=None, found_inf=None, **_) -> None:
    _check_common(lr, grad_scale, found_inf)
    n = len(self)
    _check_lengths(n, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    _check_optional_list("max_exp_avg_sqs", max_exp_avg_sqs, n, amsgrad)
    _check_lengths(n, state_steps=state_steps)
    for i, param in enumerate(self):
        _check_param("fused_adam_kernel", param)
        _check_item(state_steps[i])
        maxima = (max_exp_avg_sqs[i],) if amsgrad else ()
        _check_scalar_type(param.dtype, exp_avgs[i], exp_avg_sqs[i], *maxima, grads[i])


def _check_sgd(self, grads, momentum_buffer_list, *, momentum, lr, grad_scale=None, found_inf=None, **_) -> None:
    _check_common(lr, grad_scale, found_inf)
    n = len(self)
    _check_lengths(n, grads=grads)
    _check_optional_list("momentum_buffer_list", momentum_buffer_list, n, momentum != 0)
    for i, param in enumerate(self):
        _check_param("fused_sgd_kernel", param)
        _check_scalar_type(param.dtype, grads[i], *momentum_buffer_list[i:i + 1])


def _check_adagrad(self, grads, state_sums, state_steps, *, lr, grad_scale=None, found_inf=None, **_) -> None:
    _check_common(lr, grad_scale, found_inf)
    _check_lengths(len(self), grads=grads, state_sums=state_sums, state_steps=state_steps)
    for i, param in enumerate(self):
        _check_param("fused_adagrad_kernel", param)
        _check_scalar_type(param.dtype, grads[i], state_sums[i])
        _check_item(state_steps[i])


# --- shared by the steps ----------------------------------------------------------------------


def _double(value) -> Array:
    """A float argument or a one-element tensor lr (`lr.item<double>()`) as a float64 scalar."""
    return jnp.reshape(value, ()).astype(jnp.float64)


def _step_count(step: Array) -> Array:
    """The kernels read a step as `state_step.item<float>()` into a double."""
    return jnp.reshape(step, ()).astype(jnp.float32).astype(jnp.float64)


def _l2_decay(grad: Array, param: Array, weight_decay: Array) -> Array:
    """`grad + param * weight_decay`, unless weight_decay is 0 (which the kernels skip)."""
    return jnp.where(weight_decay != 0, grad + param * weight_decay.astype(grad.dtype), grad)


# An update of one parameter: (index, param, grad, *state) -> (param, *state), all in opmath; a
# state list the call leaves empty (no amsgrad, no momentum) is None in and out.
Update = Callable[..., tuple]


def _fused_step(params: Tensors, grads: Tensors, states: Sequence[Tensors], maximize: bool,
                grad_scale: Array | None, found_inf: Array | None, update: Update) -> tuple[tuple[Array, ...], ...]:
    """Run `update` on every parameter, in opmath: the gradient divided by `grad_scale` (and
    written back so, rounded to its dtype) and negated if `maximize`. Returns the new params,
    grads and states, lists in the order of `states`; all as they were if `found_inf` is 1."""
    skipped = None if found_inf is None else jnp.reshape(found_inf, (-1,))[0] == 1
    new_lists: list[list[Array]] = [[] for _ in range(2 + len(states))]
    for i, (param, grad) in enumerate(zip(params, grads)):
        opmath = reduction.opmath(param.dtype)
        g = grad.astype(opmath)
        unscaled = grad
        if grad_scale is not None:
            g = g / jnp.reshape(grad_scale, (-1,))[0].astype(opmath)
            unscaled = g.astype(grad.dtype)
        state = [s[i] if s else None for s in states]
        new = update(i, param.astype(opmath), -g if maximize else g,
                     *(None if s is None else s.astype(opmath) for s in state))
        for values, old, value in zip(new_lists, (param, grad, *state), (new[0], unscaled, *new[1:])):
            if old is not None:
                value = value.astype(old.dtype)
                values.append(value if skipped is None else jnp.where(skipped, old, value))
    return tuple(tuple(values) for values in new_lists)


# --- the optimizers ---------------------------------------------------------------------------


def _adam(ctx, self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
          weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None, decoupled: bool):
    """Adam (`decoupled=False`: weight decay added to the gradient) or AdamW (`decoupled`: the
    parameter scaled by `1 - lr * weight_decay`), with AMSGrad's running maximum if `amsgrad`."""
    lr = _double(lr)

    def update(i, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq):
        opmath = param.dtype
        step = _step_count(state_steps[i])
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = jnp.sqrt(1 - beta2 ** step)
        if decoupled:  # a weight decay of 0 multiplies by 1, which changes nothing (the kernel skips it)
            param = param * (1 - lr * weight_decay).astype(opmath)
        else:
            grad = _l2_decay(grad, param, weight_decay)
        exp_avg = pointwise.lerp(ctx, exp_avg, grad, (1 - beta1).astype(opmath))
        exp_avg_sq = exp_avg_sq * beta2.astype(opmath) + (1 - beta2).astype(opmath) * grad * grad
        if amsgrad:
            max_exp_avg_sq = jnp.maximum(max_exp_avg_sq, exp_avg_sq)
        second_moment = max_exp_avg_sq if amsgrad else exp_avg_sq
        denom = jnp.sqrt(second_moment) / bias_correction2_sqrt.astype(opmath) + eps.astype(opmath)
        param = param + (-step_size).astype(opmath) * exp_avg / denom
        return param, exp_avg, exp_avg_sq, max_exp_avg_sq

    return _fused_step(self, grads, (exp_avgs, exp_avg_sqs, max_exp_avg_sqs), maximize, grad_scale, found_inf, update)


registry.register(aten._fused_adam.default, aten._fused_adam.tensor_lr, dynamic_scalars=True,
                  validate=_check_adam)(partial(_adam, decoupled=False))
registry.register(aten._fused_adamw.default, aten._fused_adamw.tensor_lr, dynamic_scalars=True,
                  validate=_check_adam)(partial(_adam, decoupled=True))


@registry.register(aten._fused_sgd.default, aten._fused_sgd.tensor_lr, dynamic_scalars=True, validate=_check_sgd)
def fused_sgd(ctx, self, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov,
              maximize, is_first_step, grad_scale=None, found_inf=None):
    """SGD with optional momentum (a buffer per parameter exactly when momentum is not 0; on the
    first step it starts as the gradient), dampening and Nesterov momentum."""
    lr = _double(lr)

    def update(i, param, grad, buffer):
        opmath = param.dtype
        grad = _l2_decay(grad, param, weight_decay)
        if buffer is not None:
            momentum_ = momentum.astype(opmath)
            buffer = grad if is_first_step else buffer * momentum_ + grad * (1 - dampening).astype(opmath)
            grad = grad + buffer * momentum_ if nesterov else buffer
        return param - grad * lr.astype(opmath), buffer

    return _fused_step(self, grads, (momentum_buffer_list,), maximize, grad_scale, found_inf, update)


@registry.register(aten._fused_adagrad.default, aten._fused_adagrad.tensor_lr, dynamic_scalars=True,
                   validate=_check_adagrad)
def fused_adagrad(ctx, self, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize,
                  grad_scale=None, found_inf=None):
    """Adagrad: the lr decayed by the step count, over the root of the summed squared gradients.
    `_fused_adagrad.default` also returns the steps, unchanged (the optimizer counts them)."""
    lr = _double(lr)

    def update(i, param, grad, state_sum):
        opmath = param.dtype
        clr = lr / (1.0 + (_step_count(state_steps[i]) - 1.0) * lr_decay)
        grad = _l2_decay(grad, param, weight_decay)
        state_sum = state_sum + grad * grad
        std = jnp.sqrt(state_sum) + eps.astype(opmath)
        return param - clr.astype(opmath) * grad / std, state_sum

    new = _fused_step(self, grads, (state_sums,), maximize, grad_scale, found_inf, update)
    return new + (tuple(state_steps),) if len(ctx.op._schema.returns) > len(new) else new
