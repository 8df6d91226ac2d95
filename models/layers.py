"""Layers and config pieces shared by the model families: every model file builds its convs,
norms and linears here, so no family reaches into another's module.

Parameters are always float32 (`param_dtype`); `dtype` is the compute dtype. Initialisers
are named for what they reproduce (torchvision's, or flax's defaults).
"""

from __future__ import annotations

import contextlib
import threading
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxdist.errors import UsageError, choices
from models import fp8
from sharding.logical import activation_spec

KAIMING_FAN_OUT = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")
KAIMING_FAN_IN = nnx.initializers.variance_scaling(2.0, "fan_in", "normal")
TORCH_LINEAR = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform")  # U(+-1/sqrt(in))
LECUN_NORMAL = nnx.initializers.lecun_normal()  # nnx.Linear's and nnx.Conv's default

_TEACHER_SIZE = 32  # synthetic labels look at images through at most a 32x32 grid


# ---- convolutions -----------------------------------------------------------------------

def conv(cin, cout, k, stride=1, *, padding=None, groups=1, bias=False, init=KAIMING_FAN_OUT,
         dtype, rngs):
    """A kxk conv padded like torchvision's (symmetric `padding`, default (k-1)//2, not
    XLA's "SAME"), so every output size is torchvision's: out = (h + 2p - k) // stride + 1."""
    p = (k - 1) // 2 if padding is None else padding
    return nnx.Conv(cin, cout, (k, k), strides=stride, padding=((p, p), (p, p)),
                    feature_group_count=groups, use_bias=bias, kernel_init=init,
                    dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


def conv_out(hw, k, stride=1, padding=None):
    p = (k - 1) // 2 if padding is None else padding
    return (hw + 2 * p - k) // stride + 1


def conv_flops(k, cin, cout, hw_out, groups=1):
    """Forward FLOPs (2 x MACs) of a kxk conv producing an hw_out x hw_out map."""
    return 2 * k * k * (cin // groups) * cout * hw_out * hw_out


# ---- norms, linears, embeddings ---------------------------------------------------------

def batch_norm(c, *, epsilon=1e-5, dtype, rngs):
    # Batch statistics until model.eval() (a freshly built model normalises with the batch);
    # model.train()/model.eval() flip it. Momentum 0.9 is PyTorch's 0.1.
    return nnx.BatchNorm(c, use_running_average=False, momentum=0.9, epsilon=epsilon,
                         dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


def layer_norm(d, *, epsilon=1e-5, dtype, rngs):
    return nnx.LayerNorm(d, epsilon=epsilon, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


def rms_norm(d, *, epsilon=1e-5, dtype, rngs):
    return nnx.RMSNorm(d, epsilon=epsilon, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


class Linear(nnx.Linear):
    """nnx.Linear whose output carries its place among the matmuls of the block being traced
    (`matmul_1`, `matmul_2`, ... in call order, `counted_matmuls`), for the remat policy
    that keeps every other one (REMAT_POLICIES["selective_op"]), and its `tag` (a name of
    REMAT_NAMES' policies: `out_proj`, `mlpwi`, ...) where it has one. Built inside
    models.fp8.fp8_matmuls, its matmul runs in FP8 (`fp8`, its scaling)."""

    def __init__(self, *args, tag: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag
        self.fp8 = fp8.scales("kernel", self.dtype)

    def matmul(self, x, kernel, dims):
        """x . kernel over `dims`, both already in the compute dtype: in FP8 or as nnx.Linear."""
        if self.fp8 is not None:
            return self.fp8.dot_general(x, kernel, dims)
        return self.dot_general(x, kernel, dims, precision=self.precision)

    def __call__(self, x):
        if self.fp8 is None:
            return tagged(counted(super().__call__(x)), self.tag)
        x, kernel, bias = self.promote_dtype(
            (x, self.kernel[...], self.bias[...] if self.bias is not None else None),
            dtype=self.dtype)
        y = self.matmul(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        return tagged(counted(y if bias is None else y + bias), self.tag)


def linear(a, b, *, bias=True, init=LECUN_NORMAL, tag=None, dtype, rngs):
    return Linear(a, b, use_bias=bias, kernel_init=init, dtype=dtype,
                  param_dtype=jnp.float32, rngs=rngs, tag=tag)


def tagged(y, tag: str | None):
    """y named `tag` for the remat policies (REMAT_NAMES); y itself for no tag."""
    return y if tag is None else checkpoint_name(y, tag)


def embed(n, d, *, dtype, rngs):
    return nnx.Embed(n, d, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


# ---- activation sharding ----------------------------------------------------------------

def constrain(x, *names):
    """x pinned to the mesh axes its dimensions' logical names map to (sharding/logical.py
    ACTIVATION_RULES: "activation_batch", "activation_embed", ...; None: no name, whole);
    x unchanged where the rules do not apply (no mesh, no tensor axis)."""
    spec = activation_spec(x.shape, names)
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


def lookup(table: nnx.Embed, ids, rows="activation_vocab"):
    """table(ids) with the table pinned whole over the data axes first (its `rows`, the
    vocabulary, over tensor; None for positions): under fsdp_tp an all-gather of the weight
    shards, where XLA would otherwise gather every device's token ids and move the
    looked-up rows between data devices."""
    (weight,) = table.promote_dtype((table.embedding[...],), dtype=table.dtype, inexact=False)
    return jnp.take(constrain(weight, rows, "activation_embed"), ids, axis=0)


# Logical names of the decoders' common activations.
BLD = ("activation_batch", "activation_length", "activation_embed")      # residual stream
BLH = ("activation_batch", "activation_length", "activation_heads")      # heads, flattened
BLF = ("activation_batch", "activation_length", "activation_mlp")        # MLP hidden
BLV = ("activation_batch", "activation_length", "activation_vocab")      # logits
BLNH = ("activation_batch", "activation_length", "activation_heads", None)
BLKH = ("activation_batch", "activation_length", "activation_kv_heads", None)


# ---- decoder blocks ---------------------------------------------------------------------

# Where the block being traced is in its matmuls (Linear): per thread, like _ORDERING below.
_MATMULS = threading.local()


def counted(y):
    """y, a matmul's output, named for its place in the block: matmul_1, matmul_2, ..."""
    _MATMULS.count = getattr(_MATMULS, "count", 0) + 1
    return checkpoint_name(y, f"matmul_{_MATMULS.count}")


@contextlib.contextmanager
def counted_matmuls():
    """Number the matmuls traced inside from 1 (one block's: block_runner, the pipeline's
    stages), so a policy can pick them by their place in the block."""
    outer = getattr(_MATMULS, "count", 0)
    _MATMULS.count = 0
    try:
        yield
    finally:
        _MATMULS.count = outer


def _cudnn_attention_forward(prim, *_, **__) -> bool:
    # cuDNN flash attention's forward (jax.nn.dot_product_attention(implementation="cudnn")):
    # its outputs, the attention output and the softmax's logsumexp, are what its backward
    # reads, so keeping them is keeping SDPA's outputs as torchtitan does
    return prim.name == "dot_product_attention_fwd_wrapper"


# torchtitan's op-level selective AC (activation_checkpoint.mode "selective", option "op"):
# in each block's forward it keeps every matmul's output but every second one's (the 1st,
# 3rd, 5th, ...: a Llama block's wq, wv, w1 and w2 of wq wk wv wo w1 w3 w2; JAX keeps only
# those some backward reads, so not w2's, which torchtitan's cache holds), and the
# attention's outputs, and under sequence parallelism the reduce-scatters' outputs
# (models.sequence_parallel); everything else is recomputed. Named (MaxText's way), not counted
# inside the policy, since JAX may consult a policy more than once per equation.
_SELECTIVE_OP = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_only_these_names(
        "context", "reduce_scatter", *(f"matmul_{k}" for k in range(1, 128, 2))),
    _cudnn_attention_forward)

# MaxText's remat policies by name (its decoders' get_remat_policy), over the values every
# decoder block here names as MaxText's do: `query_proj`, `key_proj`, `value_proj` (q, k, v as
# the attention reads them: after RoPE), `context` (the attention's output, before its output
# projection; under cuDNN the kernel's own outputs), `out_proj` (the attention's output
# projection), `mlpwi` (GPT's one up projection) or `mlpwi_0` / `mlpwi_1` (SwiGLU's gate and
# up, also the MoE experts'), `mlpwo` (the MLP's down projection). Under sequence parallelism
# `out_proj` and `mlpwo` are the reduce-scattered sequence shards. (MaxText's `qkv_proj`
# names a fused q/k/v projection, which no decoder here has.)
# policy -> (names kept in device memory, names moved to host memory for the backward)
QKV = ("query_proj", "key_proj", "value_proj")
MLP = ("mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")
REMAT_NAMES = {
    "minimal": ((*QKV, "out_proj", *MLP), ()),
    "minimal_flash": ((*QKV, "context", "out_proj", *MLP), ()),
    "save_dot_with_context_except_mlp": ((*QKV, "context", "out_proj"), ()),
    "save_dot_except_mlpwi": ((*QKV, "out_proj", "mlpwo"), ()),
    "save_dot_except_mlp": ((*QKV, "out_proj"), ()),
    "save_qkv_proj": (QKV, ()),
    "save_out_proj": (("out_proj",), ()),
    "minimal_offloaded": ((), (*QKV, "out_proj", *MLP)),
    "qkv_proj_offloaded": ((), QKV),
}


def named_policy(saved: tuple[str, ...], offloaded: tuple[str, ...]):
    """A jax.checkpoint policy keeping `saved` in device memory and moving `offloaded` to
    pinned host memory (copies in the XLA program, back before the backward reads them);
    `context` also keeps cuDNN attention's outputs, which carry no name."""
    if offloaded:
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(saved), names_which_can_be_offloaded=list(offloaded),
            offload_src="device", offload_dst="pinned_host")
    else:
        policy = jax.checkpoint_policies.save_only_these_names(*saved)
    if "context" in saved:
        policy = jax.checkpoint_policies.save_from_both_policies(policy,
                                                                 _cudnn_attention_forward)
    return policy


REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.checkpoint_dots,
                  "selective_op": _SELECTIVE_OP,
                  **{name: named_policy(*kept) for name, kept in REMAT_NAMES.items()}}


def offloads(remat: str) -> bool:
    """Whether a remat policy moves saved values to host memory."""
    return bool(REMAT_NAMES.get(remat, ((), ()))[1])


BLOCK_SCOPE = "block_{}"  # a decoder block's name scope (run_blocks)


@jax.custom_vjp
def _meet(a, b):
    return jax.lax.optimization_barrier((a, b))


_meet.defvjp(lambda a, b: (jax.lax.optimization_barrier((a, b)), None),
             lambda _, cotangents: jax.lax.optimization_barrier(cotangents))


# Per thread: plans trace the hand estimate (barriers off) in a worker thread while the main
# thread lowers the step (jaxdist.predict.prediction); a process-wide switch let the step be traced
# without its barriers (Llama2-13B fsdp on 64 A100: 81.6 GiB planned instead of 72.7).
_ORDERING = threading.local()


@contextlib.contextmanager
def barriers_off():
    """run_blocks without its barriers while this thread traces: they pass parameters and
    activations through unchanged, but a barrier's outputs are new values, so a count of the
    values the backward saves (jaxdist.predict.memory) would take every block's parameters
    for residuals."""
    _ORDERING.off = True
    try:
        yield
    finally:
        _ORDERING.off = False


def run_blocks(blocks, step, carry, ordered: bool):
    """carry = step(block, carry) for each block in order. `ordered` (full remat:
    `ordered_backward`): block k+1's parameters and block k's input pass an optimization
    barrier together, in the forward and, for their gradients, in the backward. So block
    k+1's weights are not gathered before block k starts (PyTorch FSDP's one-block forward
    prefetch), and its weight gradients are made before block k-1's backward starts (block
    k's runs meanwhile, with k+1's gradient reduction in flight), as FSDP frees a block's
    gathered weights after its backward. Without them XLA's latency-hiding scheduler gathers
    weights many blocks ahead and leaves weight gradients (they feed only the optimizer) to
    the end of the backward, keeping their inputs alive across the blocks in between: the
    memory full remat is chosen to save. Measured on XLA:GPU plans: llama3-70b fsdp_tp with
    sequence parallelism held 71.3 GiB of temporaries at depth 8 and 150.5 at 16, ordered
    31.0 at 8; Llama2-70B fsdp on 64 A100 10.9 and 21.3 GiB at depth 8 and 16 with the
    backward ordered alone, 7.2 and 8.2 with both (step 2.36 s at depth 8, 2.39 unordered)."""
    blocks = list(blocks)
    ordered = ordered and not getattr(_ORDERING, "off", False)
    for k in range(len(blocks)):
        if ordered and k + 1 < len(blocks):
            graphdef, state = nnx.split(blocks[k + 1])
            state, carry = _meet(state, carry)
            blocks[k + 1] = nnx.merge(graphdef, state)
        # XLA's op metadata then says which block an op (forward, recomputed or backward)
        # belongs to: in profiles, and for jaxdist.program.liveness
        with jax.named_scope(BLOCK_SCOPE.format(k)):
            carry = step(blocks[k], carry)
    return carry


def ordered_backward(remat: str) -> bool:
    """Whether run_blocks orders the blocks whatever the layout: under full remat (see
    run_blocks). Under `dots` or none only where the layout gathers each block's weights
    (the model config's `ordered_blocks`, sharding.registry.gathers_block_weights): not
    where gradients are reduced after the backward (the Megatron-style tp plan, distributed
    optimizer and no remat, holds 48.5 GiB and takes 889 ms a step ordered, 41.0 GiB and 861
    ms unordered)."""
    return remat == "full"


def block_runner(block_cls, remat: str):
    """`block_cls.__call__` with its matmuls counted, and with remat its nnx.remat: the
    backward pass recomputes each block's activations instead of keeping them ("full" keeps
    only block inputs, "dots" also every matmul output, "selective_op" every other one and
    the attention's outputs, MaxText's names what REMAT_NAMES says)."""
    def run(block, *args):
        with counted_matmuls():
            return block_cls.__call__(block, *args)
    if remat == "none":
        return run
    return nnx.remat(run, policy=REMAT_POLICIES[remat])


class ProjectedAttention(nnx.Module):
    """Attention as sequence parallelism runs it (models/sequence_parallel.py): `project`
    (q, k and v, each token apart), then the subclass's `attend` (over the whole sequence);
    `column`, both, is everything before the row-parallel projection `out`."""

    row = "out"  # the row-parallel projection

    def __call__(self, x_BLD):
        return self.out(self.column(x_BLD))

    def column(self, x_BLD):
        """The heads' outputs, [B, L, heads x head_dim]."""
        return self.attend(*self.project(x_BLD))

    def project(self, x_BLD):
        """q, k and v, [B, L, heads x head_dim] each (before RoPE where there is one)."""
        return self.q(x_BLD), self.k(x_BLD), self.v(x_BLD)


class PreNormBlock(nnx.Module):
    """A pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)). The attribute
    names (ln1, attn, ln2, mlp) are the ones sharding/logical.py matches."""

    def __init__(self, ln1, attn, ln2, mlp):
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp

    def __call__(self, x_BLD):
        x_BLD = constrain(x_BLD + constrain(self.attn(self.ln1(x_BLD)), *BLD), *BLD)
        return constrain(x_BLD + constrain(self.mlp(self.ln2(x_BLD)), *BLD), *BLD)


# ---- config pieces ----------------------------------------------------------------------

def check_choice(family, field, value, options):
    if value not in options:
        raise UsageError(f"{family} {field}={value!r} is not supported; "
                         f"choose from {choices(map(str, options))}")


def teacher_labels(x: np.ndarray, num_classes: int) -> np.ndarray:
    """Labels from a fixed random linear teacher on the flattened input: synthetic data that
    is learnable, so the loss falls across fresh batches (random labels are only memorised)."""
    x_BD = x.reshape(x.shape[0], -1)
    teacher_DC = np.random.default_rng(0).standard_normal((x_BD.shape[1], num_classes))
    return np.argmax(x_BD @ teacher_DC, axis=1).astype(np.int32)


def classifier_loss(model, batch):
    """Mean softmax cross-entropy of `model(batch["x"])` against integer labels `y`."""
    logits_BC = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BC, batch["y"]).mean()


class ImageClassifier:
    """Batch, loss and token count of an image classifier config with fields image_size,
    channels and num_classes. `input_kind = "image"`: a dataset of images resizes the
    config's image_size, channels and num_classes (jaxdist.run_model.adapt_model)."""

    input_kind: ClassVar[str] = "image"

    def synthetic_batch(self, rng: np.random.Generator, batch_size: int):
        shape = (batch_size, self.image_size, self.image_size, self.channels)
        x_BHWC = rng.standard_normal(shape, dtype=np.float32)
        # The linear teacher sees large images average-pooled to ~32x32 (still a linear
        # function of the image, so still learnable): a 224x224x3 teacher would be a 150528 x
        # 1000 matrix, 1.2 GB and seconds per batch. Up to 32x32 this is teacher_labels itself.
        f = max(1, self.image_size // _TEACHER_SIZE)
        side = self.image_size // f * f
        pooled = x_BHWC[:, :side, :side].reshape(
            batch_size, side // f, f, side // f, f, self.channels).mean(axis=(2, 4))
        return {"x": x_BHWC, "y": teacher_labels(pooled, self.num_classes)}

    def loss(self, model, batch):
        return classifier_loss(model, batch)

    @property
    def tokens_per_sample(self) -> int:
        return 0

    def check_fits(self, final_hw: int, why: str) -> None:
        if final_hw < 1:
            raise UsageError(f"{self.family}: image_size={self.image_size} is too small for "
                             f"{why}; use a larger image or the other stem")
