"""The fused recurrent cells that `nn.LSTM` / `nn.GRU` (and `nn.LSTMCell` / `nn.GRUCell`) run on
an accelerator.

PyTorch's composite LSTM and GRU call, off the CPU, one fused op per time step for the cell's
pointwise part -- the gate matmuls stay ordinary `mm`s -- and one for its gradient, which reads a
workspace the forward saved. The forward and backward here are each other's pair (the
workspace's layout is theirs alone) and compute what PyTorch's CUDA kernels compute
(aten/src/ATen/native/cuda/RNN.cu): gates in the order input, forget, cell, output (LSTM) and
reset, update, new (GRU), in the gates' dtype. The reference the tests hold them to is the CPU's
unfused cells.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchtpu.ops import registry

aten = torch.ops.aten


def _gates(input_gates, hidden_gates, input_bias, hidden_bias, count: int):
    """`input_gates + hidden_gates` (+ the biases), split into `count` gates."""
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    return jnp.split(gates, count, axis=1)


def _lstm_cell_meta(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """PyTorch's meta kernel, which fails on a cell without biases (it asks the absent biases
    for their device): the states are `cx`'s shape, the workspace the gates'."""
    if input_bias is not None:
        return aten._thnn_fused_lstm_cell.default(input_gates, hidden_gates, cx, input_bias, hidden_bias)
    return torch.empty_like(cx), torch.empty_like(cx), torch.empty_like(input_gates)


@registry.register(aten._thnn_fused_lstm_cell.default, meta=_lstm_cell_meta)
def lstm_cell(ctx, input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """The new hidden and cell states, and the workspace: the four activated gates."""
    i, f, g, o = _gates(input_gates, hidden_gates, input_bias, hidden_bias, 4)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    return o * jnp.tanh(cy), cy, jnp.concatenate([i, f, g, o], axis=1)


@registry.register(aten._thnn_fused_lstm_cell_backward_impl.default)
def lstm_cell_backward(ctx, grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """The gradients of the gates (pre-activation), of `cx`, and of the bias (the gates'
    gradient summed over the batch) when the cell has one. An absent output gradient is zero."""
    i, f, g, o = jnp.split(workspace, 4, axis=1)
    grad_hy = jnp.zeros_like(cy) if grad_hy is None else grad_hy
    tanh_cy = jnp.tanh(cy)
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        grad_c = grad_c + grad_cy
    grad_gates = jnp.concatenate([
        grad_c * g * i * (1 - i),
        grad_c * cx * f * (1 - f),
        grad_c * i * (1 - g * g),
        grad_hy * tanh_cy * o * (1 - o),
    ], axis=1)
    return grad_gates, grad_c * f, grad_gates.sum(axis=0) if has_bias else None


@registry.register(aten._thnn_fused_gru_cell.default)
def gru_cell(ctx, input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """The new hidden state, and the workspace: the reset, update and new gates, `hx` and the
    hidden part of the new gate (which the reset gate scales)."""
    if input_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    ir, iz, in_ = jnp.split(input_gates, 3, axis=1)
    hr, hz, hn = jnp.split(hidden_gates, 3, axis=1)
    r, z = jax.nn.sigmoid(ir + hr), jax.nn.sigmoid(iz + hz)
    n = jnp.tanh(in_ + r * hn)
    return n + z * (hx - n), jnp.concatenate([r, z, n, hx, hn], axis=1)


@registry.register(aten._thnn_fused_gru_cell_backward.default)
def gru_cell_backward(ctx, grad_hy, workspace, has_bias):
    """The gradients of the input gates, the hidden gates, `hx`, and (with a bias) of both
    biases: the gates' gradients summed over the batch."""
    r, z, n, hx, hn = jnp.split(workspace, 5, axis=1)
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_r = grad_n * hn * r * (1 - r)
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_input_gates = jnp.concatenate([grad_r, grad_z, grad_n], axis=1)
    grad_hidden_gates = jnp.concatenate([grad_r, grad_z, grad_n * r], axis=1)
    if not has_bias:
        return grad_input_gates, grad_hidden_gates, grad_hy * z, None, None
    return (grad_input_gates, grad_hidden_gates, grad_hy * z,
            grad_input_gates.sum(axis=0), grad_hidden_gates.sum(axis=0))
