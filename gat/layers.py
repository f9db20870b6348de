"""Graph attention, computed edge by edge, for R independent replicas (seeds) at once."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gat.dropout import ReplicaDropout
from gat.graph import Neighbourhoods, SparseFeatures, csr_beta_warning_silenced


def _glorot(fan_in: int, fan_out: int, *shape: int, generator: torch.Generator) -> Tensor:
    """Glorot-uniform values in ±sqrt(6 / (fan_in + fan_out)), drawn from `generator`."""
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return (torch.rand(*shape, generator=generator) * 2 - 1) * bound


def per_replica(product: Callable[[Tensor, Tensor], Tensor], left: Tensor, right: Tensor) -> Tensor:
    """torch.stack of product(left[r], right[r]) over the replicas r: one dense BLAS call per replica.

    MKL's batched kernels round a matrix differently depending on its position in the batch (on
    Cora's shapes too), so a product batched over replicas would make a seed's result depend on
    its batch-mates. Each replica's operands go to BLAS in a call of their own instead.

    Shapes: left: [R, ...], right: [R, ...]
    """
    return torch.stack([product(left_r, right_r) for left_r, right_r in zip(left, right)])


@dataclass(frozen=True)
class _BlockPlan:
    """Index structure of a block-diagonal CSR matrix diag(M_1, ..., M_B) and of its transpose.

    Every block shares the sparsity pattern of one base matrix M (the features x, or the
    neighbourhoods' adjacency); only the values differ per block and per step, so the
    structure is built once and kept on M's object (`memoised`). Values are laid out block
    after block, each in M's CSR order.
    """

    crow: Tensor     # int32, as are col, t_crow and t_col
    col: Tensor
    rows: Tensor     # the block row of every stored value: [B·nnz]
    lengths: Tensor  # stored values per block row: [B·n]
    shape: tuple[int, int]
    t_crow: Tensor
    t_col: Tensor
    t_order: Tensor  # one block's values in the transpose's order: block b's are values_b[t_order]
    t_shape: tuple[int, int]

    @classmethod
    def build(cls, crow: Tensor, col: Tensor, num_cols: int, blocks: int) -> "_BlockPlan":
        """Block b's rows are b·n .. b·n + n - 1, its columns b·num_cols .. b·num_cols + num_cols - 1."""
        n, nnz = crow.numel() - 1, col.numel()
        block = torch.arange(blocks, device=col.device)[:, None]
        row = torch.repeat_interleave(torch.arange(n, device=col.device), crow.diff())
        order = torch.argsort(col * n + row)  # M^T in CSR: M's values sorted by (column, row)
        t_crow = torch.zeros(num_cols + 1, dtype=torch.long, device=col.device)
        t_crow[1:] = torch.bincount(col, minlength=num_cols).cumsum(0)

        def blocks_of(pointers: Tensor) -> Tensor:
            return torch.cat([(pointers[:-1] + block * nnz).reshape(-1), pointers.new_tensor([blocks * nnz])])

        # MKL's sparse kernels take 32-bit indices; int64 ones would be converted on every product.
        return cls(crow=blocks_of(crow).int(), col=(col + block * num_cols).reshape(-1).int(),
                   rows=(row + block * n).reshape(-1), lengths=crow.diff().repeat(blocks),
                   shape=(blocks * n, blocks * num_cols), t_crow=blocks_of(t_crow).int(),
                   t_col=(row[order] + block * n).reshape(-1).int(), t_order=order,
                   t_shape=(blocks * num_cols, blocks * n))

    def matrix(self, values: Tensor) -> Tensor:
        return torch.sparse_csr_tensor(self.crow, self.col, values, self.shape, check_invariants=False)

    def transpose(self, values: Tensor) -> Tensor:
        # One block's permutation applied to every block: an index of nnz, not B·nnz, stays in cache.
        transposed = values.view(-1, self.t_order.numel()).index_select(1, self.t_order).view(-1)
        return torch.sparse_csr_tensor(self.t_crow, self.t_col, transposed, self.t_shape, check_invariants=False)


@dataclass(frozen=True)
class _InferencePlan:
    """Index structure of the inference pass, which keeps everything node-major.

    The features of B blocks come as one matrix [N_src, B, F'] (a row per node), so the
    scores are edge-major, [E, B]: a neighbourhood's scores are one contiguous run of rows,
    reduced along axis 0. The aggregation then reads them in (target, block, edge) order,
    one bag of α-weighted rows per output row (i, b).
    """

    edges: Tensor        # [E] 0 .. E-1: every edge is a bag member of its target's segment sum
    order: Tensor        # [B·E] position in the edge-major scores of the (i, b, edge) entries
    bag_offsets: Tensor  # [T·B + 1] start of bag (i, b) among those entries
    bag_rows: Tensor     # [B·E] row j·B + b of the node-major features [N_src·B, F'] that each entry reads

    @classmethod
    def build(cls, neighbourhoods: Neighbourhoods, blocks: int) -> "_InferencePlan":
        device = neighbourhoods.crow.device
        per_bag = neighbourhoods.degree.repeat_interleave(blocks)  # bag (i, b) holds i's neighbourhood
        bag_offsets = torch.cat([per_bag.new_zeros(1), per_bag.cumsum(0)])
        bag = torch.repeat_interleave(torch.arange(per_bag.numel(), device=device), per_bag)
        target, block = bag // blocks, bag % blocks
        edge = neighbourhoods.crow[target] + torch.arange(bag.numel(), device=device) - bag_offsets[bag]
        # 32-bit indices: half the memory traffic of a pass that mostly moves indices and rows.
        return cls(edges=torch.arange(neighbourhoods.num_edges, device=device), order=(edge * blocks + block).int(),
                   bag_offsets=bag_offsets.int(), bag_rows=(neighbourhoods.source[edge] * blocks + block).int())


class _BlockSparseMatmul(torch.autograd.Function):
    """diag(M_1, ..., M_B) @ D with CSR kernels, forward and backward.

    The gradient of D is the product with the precomputed transpose (autograd's own sparse
    transpose rebuilds the structure every step and costs more than the product). The
    gradient of the values, when they need one (attention coefficients, not input features),
    is the sampled product grad @ D^T at the stored positions only: O(nnz·F'), where gathering
    both sides per edge would move E·B·F' floats through memory twice.
    """

    @staticmethod
    def forward(ctx, values: Tensor, dense: Tensor, plan: _BlockPlan) -> Tensor:
        ctx.plan = plan
        ctx.save_for_backward(values, dense)
        with csr_beta_warning_silenced():
            return plan.matrix(values) @ dense

    @staticmethod
    def backward(ctx, grad: Tensor):
        values, dense = ctx.saved_tensors
        plan = ctx.plan
        grad_values = None
        with csr_beta_warning_silenced():
            if ctx.needs_input_grad[0]:
                grad_values = torch.sparse.sampled_addmm(plan.matrix(values), grad, dense.t(), beta=0.0).values()
            return grad_values, plan.transpose(values) @ grad, None


class _AddBias(torch.autograd.Function):
    """out + bias, with the bias gradient summed along a contiguous innermost axis.

    Autograd's own reduction over the node axis picks its vectorisation by the whole
    tensor's shape, so a replica's bias gradient would change in its last bits with the
    number of replicas beside it; one contiguous row per (replica, head, feature) doesn't.

    Shapes: out: [R, H, N, F'], bias: [R, H, F']
    """

    @staticmethod
    def forward(ctx, out: Tensor, bias: Tensor) -> Tensor:
        return out + bias.unsqueeze(2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.transpose(2, 3).contiguous().sum(-1)


class _ELU(torch.autograd.Function):
    """ELU on a contiguous tensor, with a contiguous gradient.

    torch rounds exp() differently in the vectorised body of its loops and in the scalar
    remainder or a strided pass. Kept contiguous, with every replica's slice a multiple of the
    vector width, each element takes the same path whatever the number of replicas.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x)
        return F.elu(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.aten.elu_backward(grad.contiguous(), 1.0, 1.0, 1.0, False, x)


def elu(x: Tensor) -> Tensor:
    """ELU whose result for each element does not depend on the tensor around it.

    Shapes: x: [R, ...] replica-major, or [N, R, ...] node-major
    """
    if x[0].numel() % 32 == 0:  # two AVX-512 vectors, the widest step of torch's CPU loops: no remainder
        return _ELU.apply(x)
    # Otherwise replica slices straddle the loop's steps; this formula's ops round the same everywhere.
    return torch.where(x > 0, x, torch.expm1(x.clamp(max=0)))


class _SegmentSoftmax(torch.autograd.Function):
    """segment_softmax with its gradient in closed form: ∂L/∂e = α ∘ (g - Σ_segment g ∘ α) for g = ∂L/∂α.

    That is five passes over the scores; autograd's chain through max, exp, sum and the gathers takes twice as many.
    The forward pass works in place on its own intermediates, which autograd never sees.
    """

    @staticmethod
    def forward(ctx, e: Tensor, lengths: Tensor, rows: Tensor, segment_sum: Callable[[Tensor], Tensor]) -> Tensor:
        shift = torch.segment_reduce(e, "max", lengths=lengths, axis=0, unsafe=True)
        exp = (e - shift.index_select(0, rows)).exp_()
        alpha = exp.div_(segment_sum(exp).index_select(0, rows))
        ctx.segment_sum = segment_sum
        ctx.save_for_backward(alpha, rows)
        return alpha

    @staticmethod
    def backward(ctx, grad: Tensor):
        alpha, rows = ctx.saved_tensors
        weighted = grad * alpha
        total = ctx.segment_sum(weighted).index_select(0, rows)
        return weighted - alpha * total, None, None, None


def segment_softmax(e: Tensor, lengths: Tensor, rows: Tensor,
                    segment_sum: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Softmax of scores grouped in contiguous segments along axis 0 (one per target node and block).

    Subtracting each segment's max keeps exp() from overflowing; softmax is invariant to
    the shift, so it does not enter the gradient. `segment_sum` sums each segment, [S, ...] -> [G, ...]:
    segment_reduce by default; the node-major inference pass brings a faster one for its [E, B] scores.

    Shapes:
        e: [S] or [S, B] scores, segment after segment; lengths: [G] segment sizes; rows: [S] segment of each score
    """
    if segment_sum is None:
        def segment_sum(x: Tensor) -> Tensor:
            return torch.segment_reduce(x, "sum", lengths=lengths, axis=0, unsafe=True)
    return _SegmentSoftmax.apply(e, lengths, rows, segment_sum)


class GraphAttentionLayer(nn.Module):
    r"""Multi-head graph attention (Veličković et al. 2018), edge-wise, for R replicas at once.

    For head k, each node i and each j in its neighbourhood N(i) (i itself included):

    .. math::
        g_i = W^k h_i, \qquad
        e_{ij} = \mathrm{LeakyReLU}\big(a_1^k \cdot g_i + b_1^k + a_2^k \cdot g_j + b_2^k\big),

        \alpha_{ij} = \frac{\exp(e_{ij} - \max_{l \in N(i)} e_{il})}{\sum_{l \in N(i)} \exp(e_{il} - \max_{l} e_{il})},
        \qquad h'_i = \sum_{j \in N(i)} \alpha_{ij} g_j + c^k

    The heads are concatenated (`is_concat`) or averaged. This is the annotated tutorial's
    layer, with the tutorial's constructor (but `dropout` and the slope without defaults: the paper's values
    are parameters, in params.yaml), and the score a^T[g_i || g_j] is split into a
    per-node target half and source half that are gathered to edges, so memory is O(E·H),
    not the tutorial's O(N²·H).

    As in the authors' code, a_1 and a_2 carry biases b_1, b_2, each head adds an output bias
    c^k, and `dropout` hits three places: the layer input (a fresh mask per head), the
    transformed features g, and the attention coefficients α.

    The module's mode picks the layout. Training mode (`train()`) lays the R·H (replica, head)
    blocks out one after the other, so that each block gets its own dropout masks and its
    gradients reduce along contiguous rows. Eval mode (`eval()`: validation, testing, prediction)
    has no dropout and computes the same function node-major, with the first layer's input
    product shared by all blocks, in fewer and faster kernels; it is differentiable too.

    Args:
        in_features: F_in.
        out_features: H·F' when `is_concat`, else F' (the tutorial's convention).
        n_heads: H.
        is_concat: concatenate the heads' outputs, or average them.
        dropout: drop probability p.
        leaky_relu_negative_slope: slope of LeakyReLU in e_ij.
        n_replicas: R independent copies of every parameter (one per seed).
        activation: applied to each head's output before concatenating or averaging (ELU in layer 1).

    Shapes:
        h: [N_src, R, F_in] dense, or :class:`SparseFeatures` x: [N_src, F_in] shared by all replicas
        output: [N_dst, R, H·F'] if `is_concat`, else [N_dst, R, F']  (N_src = N_dst = N on a whole graph)
    """

    def __init__(self, in_features: int, out_features: int, n_heads: int, *, dropout: float,
                 leaky_relu_negative_slope: float, is_concat: bool = True, n_replicas: int = 1,
                 activation: Callable[[Tensor], Tensor] | None = None):
        super().__init__()
        if is_concat and out_features % n_heads:
            raise ValueError(f"out_features ({out_features}) must be a multiple of n_heads ({n_heads}) to concatenate")
        self.in_features, self.n_heads, self.is_concat = in_features, n_heads, is_concat
        self.n_hidden = out_features // n_heads if is_concat else out_features
        self.dropout, self.negative_slope, self.activation = dropout, leaky_relu_negative_slope, activation
        shape = (n_replicas, n_heads)
        self.W = nn.Parameter(torch.empty(*shape, in_features, self.n_hidden))
        self._attention_parameters(shape)
        self.bias = nn.Parameter(torch.zeros(*shape, self.n_hidden))
        self.reset_parameters([torch.Generator().manual_seed(r) for r in range(n_replicas)])

    variant = "gat"  # model.attention's name for the variant (gat.config.ModelConfig.attention)

    def _attention_parameters(self, shape: tuple[int, int]) -> None:
        """Register the parameters that score edges, after W and before the output bias (state_dict order)."""
        self.a_target = nn.Parameter(torch.empty(*shape, self.n_hidden))  # a_1: scores the receiving node i
        self.a_source = nn.Parameter(torch.empty(*shape, self.n_hidden))  # a_2: scores the neighbour j
        # b_1 and b_2 only ever appear summed, but Adam and L2 treat them as two variables, as the authors' code does.
        self.b_target = nn.Parameter(torch.zeros(shape))
        self.b_source = nn.Parameter(torch.zeros(shape))

    @property
    def n_replicas(self) -> int:
        return self.W.shape[0]

    def reset_parameters(self, generators: Sequence[torch.Generator]) -> None:
        """Glorot-uniform weights (1x1 convolutions in the authors' code), zero biases.

        Replica r draws from generators[r] alone: first the paper's layer's draws (:meth:`reset_shared`), then the
        variant's own (:meth:`reset_extra`; none for `gat`). A model makes the first pass over all its layers
        before the second, so W is the same for a seed whichever the variant (gat.model.GAT.reset_parameters).
        """
        self.reset_shared(generators)
        self.reset_extra(generators)

    @torch.no_grad()
    def reset_shared(self, generators: Sequence[torch.Generator]) -> None:
        """The paper's layer's draws, W then a_1 then a_2 of each replica, and zero biases.

        The variants consume the same draws in the same order, whatever of them they keep.
        """
        for r, generator in enumerate(generators):
            self.W[r] = _glorot(self.in_features, self.n_hidden, *self.W.shape[1:], generator=generator)
            a_target = _glorot(self.n_hidden, 1, self.n_heads, self.n_hidden, generator=generator)
            a_source = _glorot(self.n_hidden, 1, self.n_heads, self.n_hidden, generator=generator)
            self._keep_attention_draws(r, a_target, a_source)
        for name, parameter in self.named_parameters():
            if name.startswith("b"):  # b_target, b_source and the output bias
                parameter.zero_()

    def _keep_attention_draws(self, r: int, a_target: Tensor, a_source: Tensor) -> None:
        self.a_target[r] = a_target
        self.a_source[r] = a_source

    def reset_extra(self, generators: Sequence[torch.Generator]) -> None:
        """Draws of parameters that the paper's layer doesn't have, after every layer's :meth:`reset_shared`."""

    def _transform(self, h: Tensor | SparseFeatures, noise: ReplicaDropout | None, W: Tensor | None = None) -> Tensor:
        """g = W^k · dropout_k(h) for every replica and head (`W`: self.W unless given, [R, H, F_in, F_out]).

        Shapes: g: [R·H, N, F_out] (block-major)
        """
        W = self.W if W is None else W
        R, H, F_out = self.n_replicas, self.n_heads, W.shape[-1]
        if isinstance(h, SparseFeatures):
            # Block b multiplies x under its own mask, diag(x ∘ m_1, ..., x ∘ m_B) @ [W_1; ...; W_B].
            values = h.values.expand(R, H, h.nnz)
            if noise is not None:
                values = values * noise.keep(H, h.nnz, device=h.values.device)
            build = functools.partial(_BlockPlan.build, h.crow, h.col, h.num_features, R * H)
            plan = h.memoised((_BlockPlan, R * H), build)
            g = _BlockSparseMatmul.apply(values.reshape(-1), W.reshape(-1, F_out), plan)
            return g.view(R * H, h.num_nodes, F_out)
        N = h.shape[0]
        h = h.transpose(0, 1).contiguous().unsqueeze(1)  # [R, 1, N, F_in]: one input, a mask per head
        if noise is not None:
            h = h * noise.keep(H, N, h.shape[-1], device=h.device)
        return per_replica(torch.matmul, h, W).view(R * H, N, F_out)

    def forward(self, h: Tensor | SparseFeatures, neighbourhoods: Neighbourhoods,
                noise: ReplicaDropout | None = None) -> Tensor:
        """`noise` draws the dropout masks in training mode (None: no dropout); eval mode has none.

        `h` holds the features of the neighbourhoods' sources; the output is for its targets.
        """
        if not self.training:
            if noise is not None:
                raise ValueError("dropout noise was passed to a layer in eval mode: call train() to apply dropout")
            return self._infer(h, neighbourhoods)
        return self._blockwise(h, neighbourhoods, noise)

    def _blockwise(self, h: Tensor | SparseFeatures, neighbourhoods: Neighbourhoods, noise: ReplicaDropout | None,
                   attention: list[Tensor] | None = None) -> Tensor:
        """The training mode's block-major pass; `attention` as in :meth:`_infer`.

        Shapes: as :meth:`forward`
        """
        R, H, F_out = self.n_replicas, self.n_heads, self.n_hidden
        B, n_targets, n_sources = R * H, neighbourhoods.num_targets, neighbourhoods.num_sources
        plan = neighbourhoods.memoised((_BlockPlan, B), functools.partial(
            _BlockPlan.build, neighbourhoods.crow, neighbourhoods.source, n_sources, B))
        g, alpha = self._messages_and_coefficients(h, neighbourhoods, noise, plan)  # [B, n_sources, F'], [B·E]
        if attention is not None:
            attention.append(alpha.detach().view(R, H, -1).permute(2, 0, 1))  # [E, R, H]

        if noise is not None:
            alpha = alpha * noise.keep(H, neighbourhoods.num_edges, device=alpha.device).view(-1)
            g = g * noise.keep(H, n_sources, F_out, device=g.device).view(B, n_sources, F_out)

        # h'_i = Σ_j α_ij g_j for all blocks at once: a block-diagonal sparse-dense product.
        out = _BlockSparseMatmul.apply(alpha, g.reshape(B * n_sources, F_out), plan)
        out = _AddBias.apply(out.view(R, H, n_targets, F_out), self.bias)
        if self.activation is not None:
            out = self.activation(out)  # per head, before heads are joined, as the authors' attn_head does
        if self.is_concat:
            return out.permute(2, 0, 1, 3).reshape(n_targets, R, H * F_out)
        return out.mean(dim=1).transpose(0, 1)

    def _messages_and_coefficients(self, h: Tensor | SparseFeatures, neighbourhoods: Neighbourhoods,
                                   noise: ReplicaDropout | None, plan: _BlockPlan) -> tuple[Tensor, Tensor]:
        """The messages g_j (before their dropout) and the coefficients α_ij (before theirs) of every block.

        The input's dropout mask is drawn here, before the other two: every variant draws the same masks.

        Shapes: g: [B, N_src, F'] (B = R·H blocks, block-major); α: [B·E], each block's edges in their CSR order
        """
        R, H, F_out = self.n_replicas, self.n_heads, self.n_hidden
        B, n_sources = R * H, neighbourhoods.num_sources
        # B = R·H blocks of (replica, head), laid out block after block: [B, n_sources, F'].
        g = self._transform(h, noise)

        # a^T [g_i || g_j] = a_1·g_i + a_2·g_j: score each node once, then gather to edges (O(E), not O(N²)).
        a = torch.stack([self.a_target, self.a_source], dim=-1)  # [R, H, F', 2]
        scores = per_replica(torch.matmul, g.view(R, H, n_sources, F_out), a).view(B, n_sources, 2)
        scores = scores + torch.stack([self.b_target, self.b_source], dim=-1).view(B, 1, 2)
        score_target, score_source = scores.unbind(-1)  # [B, n_sources] each
        if neighbourhoods.target_in_source is not None:
            score_target = score_target.index_select(1, neighbourhoods.target_in_source)
        e = F.leaky_relu(score_target.index_select(1, neighbourhoods.target)
                         + score_source.index_select(1, neighbourhoods.source), self.negative_slope)
        return g, segment_softmax(e.view(-1), plan.lengths, plan.rows)  # [B·E]

    def _infer(self, h: Tensor | SparseFeatures, neighbourhoods: Neighbourhoods,
               attention: list[Tensor] | None = None) -> Tensor:
        """The same layer without dropout, laid out for speed: node-major throughout.

        Differentiable, for eval-mode gradients: its in-place steps overwrite nothing that autograd keeps.
        When `attention` is a list, the coefficients α are appended to it, [E, R, H] in the neighbourhoods'
        edge order (gat.model.GAT.attention): the very α this pass aggregates with.

        Shapes: as :meth:`forward`; internally g: [N_src, B, F'], scores: [E, B]
        """
        R, H, F_out = self.n_replicas, self.n_heads, self.n_hidden
        B, n_targets, n_sources = R * H, neighbourhoods.num_targets, neighbourhoods.num_sources
        if isinstance(h, SparseFeatures):
            # No dropout: every block sees the same x, so one wide product x @ [W_1 ... W_B];
            # embedding_bag is the fastest sparse-dense product torch has on CPU (3x MKL's CSR here).
            wide = self.W.permute(2, 0, 1, 3).reshape(h.num_features, B * F_out)
            g = F.embedding_bag(h.col, wide, h.crow, mode="sum", per_sample_weights=h.values, include_last_offset=True)
        else:
            # g^T = W^T h^T: with the nodes as the long output axis, BLAS is 4x faster on these shapes.
            h = h.transpose(0, 1).contiguous()  # [R, N_src, F_in]
            W = self.W.transpose(2, 3).reshape(R, H * F_out, -1)
            g = per_replica(torch.mm, W, h.transpose(1, 2)).permute(2, 0, 1).contiguous()
        g = g.view(n_sources, R, H * F_out)

        # Both halves of a for all heads of a replica as one block-diagonal [H·F', 2H] matrix: column k·H + h
        # holds a_k of head h, so one product scores every node, and each half comes out as [N_src, B].
        a = torch.stack([self.a_target, self.a_source], dim=2)  # [R, H, 2, F']
        a = torch.diag_embed(a.permute(0, 3, 2, 1)).permute(0, 3, 1, 2, 4).reshape(R, H * F_out, 2 * H)
        replica_major = g.transpose(0, 1).contiguous()  # [R, N_src, H·F']
        scores = per_replica(torch.mm, replica_major, a)  # [R, N_src, 2H]
        scores = scores.view(R, n_sources, 2, H).permute(2, 1, 0, 3).reshape(2, n_sources, B)
        score_target, score_source = scores.unbind(0)
        if neighbourhoods.target_in_source is not None:
            score_target = score_target.index_select(0, neighbourhoods.target_in_source)
        score_target = score_target + (self.b_target + self.b_source).view(B)
        e = F.leaky_relu(score_target.index_select(0, neighbourhoods.target)  # [E, B]
                         + score_source.index_select(0, neighbourhoods.source), self.negative_slope, inplace=True)

        # segment_softmax() along the edge axis: each neighbourhood is a contiguous run of rows of B scores,
        # and embedding_bag sums such runs several times faster than segment_reduce does.
        plan = neighbourhoods.memoised((_InferencePlan, B), functools.partial(_InferencePlan.build, neighbourhoods, B))

        def sum_runs(x: Tensor) -> Tensor:
            return F.embedding_bag(plan.edges, x, neighbourhoods.crow, mode="sum", include_last_offset=True)

        alpha = segment_softmax(e, neighbourhoods.degree, neighbourhoods.target, sum_runs)  # [E, B]
        if attention is not None:
            attention.append(alpha.view(-1, R, H))  # column r·H + h of [E, B] is replica r's head h

        # h'_i = Σ_j α_ij g_j: one bag of α-weighted rows of g per (target, block).
        out = F.embedding_bag(plan.bag_rows, g.view(-1, F_out), plan.bag_offsets, mode="sum",
                              per_sample_weights=alpha.view(-1).index_select(0, plan.order), include_last_offset=True)
        out = out.view(n_targets, R, H, F_out).add_(self.bias)
        if self.activation is not None:
            out = self.activation(out)
        if self.is_concat:
            return out.reshape(n_targets, R, H * F_out)
        return out.mean(dim=2)


class GATv2Layer(GraphAttentionLayer):
    r"""Dynamic attention (Brody et al. 2022, "How Attentive are Graph Attention Networks?"), R replicas at once.

    For head k, with separate projections of the neighbour j (the message) and of the receiving node i:

    .. math::
        g_j = W^k h_j + b_s^k, \qquad t_i = W_t^k h_i + b_t^k, \qquad
        e_{ij} = a^k \cdot \mathrm{LeakyReLU}\big(t_i + g_j\big),

        \alpha_{ij} = \mathrm{softmax}_{j \in N(i)}(e_{ij}), \qquad h'_i = \sum_{j \in N(i)} \alpha_{ij} g_j + c^k

    The nonlinearity sits between a and the projections, so the ranking of the neighbours can depend on i
    (the paper's layer ranks them the same for every i). This is PyG's `GATv2Conv` with its defaults
    (`share_weights=False`, `add_self_loops=True`, `bias=True`): W is its `lin_l` (the source, whose output
    is also the message), W_t its `lin_r`, b_s and b_t their biases; the output bias c^k is per head as in
    :class:`GraphAttentionLayer`. Dropout as there: the input (one mask per head, shared by both
    projections), the messages g and the coefficients α. There is no per-node score to gather: the
    LeakyReLU of each edge's F' features, an [R·H, E, F'] tensor, is the cost of the dynamic ranking.

    Initialisation (:meth:`reset_shared`): W and a take the draws of the paper's layer's W and a_1, its a_2
    draw is drawn and dropped, and W_t is drawn after every layer's shared draws (:meth:`reset_extra`); so
    a seed's W, in both layers, is the paper's model's W for that seed.

    Args, shapes and modes: as :class:`GraphAttentionLayer`; eval mode runs the training layout without
    dropout (there is no node-major pass for this variant).
    """

    variant = "gatv2"

    def _attention_parameters(self, shape: tuple[int, int]) -> None:
        self.W_target = nn.Parameter(torch.empty(*shape, self.in_features, self.n_hidden))
        self.a = nn.Parameter(torch.empty(*shape, self.n_hidden))
        self.b_target = nn.Parameter(torch.zeros(*shape, self.n_hidden))  # lin_r's bias
        self.b_source = nn.Parameter(torch.zeros(*shape, self.n_hidden))  # lin_l's: part of the message

    def _keep_attention_draws(self, r: int, a_target: Tensor, a_source: Tensor) -> None:
        self.a[r] = a_target

    @torch.no_grad()
    def reset_extra(self, generators: Sequence[torch.Generator]) -> None:
        for r, generator in enumerate(generators):
            self.W_target[r] = _glorot(self.in_features, self.n_hidden, *self.W_target.shape[1:], generator=generator)

    def _messages_and_coefficients(self, h: Tensor | SparseFeatures, neighbourhoods: Neighbourhoods,
                                   noise: ReplicaDropout | None, plan: _BlockPlan) -> tuple[Tensor, Tensor]:
        R, H, F_out = self.n_replicas, self.n_heads, self.n_hidden
        B, E = R * H, neighbourhoods.num_edges
        # Both projections of the same dropped-out input in one product: [W | W_t] of [R, H, F_in, 2F'].
        both = self._transform(h, noise, torch.cat([self.W, self.W_target], dim=-1))  # [B, n_sources, 2F']
        both = both + torch.cat([self.b_source, self.b_target], dim=-1).view(B, 1, 2 * F_out)
        g, t = both[..., :F_out].contiguous(), both[..., F_out:]
        if neighbourhoods.target_in_source is not None:
            t = t.index_select(1, neighbourhoods.target_in_source)
        z = F.leaky_relu(t.index_select(1, neighbourhoods.target) + g.index_select(1, neighbourhoods.source),
                         self.negative_slope)  # [B, E, F']
        # a · z per edge, one product per replica (its heads batched): a replica's e never sees its batch-mates.
        e = per_replica(torch.matmul, z.view(R, H, E, F_out), self.a.unsqueeze(-1))  # [R, H, E, 1]
        return g, segment_softmax(e.view(-1), plan.lengths, plan.rows)  # [B·E]

    def _infer(self, h: Tensor | SparseFeatures, neighbourhoods: Neighbourhoods,
               attention: list[Tensor] | None = None) -> Tensor:
        return self._blockwise(h, neighbourhoods, None, attention)


class ConstantAttentionLayer(GraphAttentionLayer):
    r"""The ablation's control: every neighbour weighs the same, self-loop included.

    .. math::
        g_j = W^k h_j, \qquad \alpha_{ij} = \frac{1}{|N(i)|}, \qquad h'_i = \sum_{j \in N(i)} \alpha_{ij} g_j + c^k

    Everything but the scores is :class:`GraphAttentionLayer`'s: the projection, the dropout of the input,
    of g and of the α (so a neighbour is still dropped at random), the output bias, the activation and the
    heads (which differ only by W). It has no attention parameters. Its initialisation draws the paper's
    layer's W, a_1 and a_2 and keeps W alone, so a seed's W, in both layers, is the paper's model's W for it.

    Args, shapes and modes: as :class:`GraphAttentionLayer`; eval mode runs the training layout without dropout.
    """

    variant = "constant"

    def _attention_parameters(self, shape: tuple[int, int]) -> None:
        """None: α is fixed by the graph."""

    def _keep_attention_draws(self, r: int, a_target: Tensor, a_source: Tensor) -> None:
        """Drawn only to keep the seed's stream where the paper's layer leaves it."""

    def _messages_and_coefficients(self, h: Tensor | SparseFeatures, neighbourhoods: Neighbourhoods,
                                   noise: ReplicaDropout | None, plan: _BlockPlan) -> tuple[Tensor, Tensor]:
        g = self._transform(h, noise)
        uniform = neighbourhoods.degree.to(g.dtype).reciprocal().index_select(0, neighbourhoods.target)  # [E]
        return g, uniform.repeat(self.n_replicas * self.n_heads)  # [B·E]

    def _infer(self, h: Tensor | SparseFeatures, neighbourhoods: Neighbourhoods,
               attention: list[Tensor] | None = None) -> Tensor:
        return self._blockwise(h, neighbourhoods, None, attention)


LAYERS: dict[str, type[GraphAttentionLayer]] = {layer.variant: layer for layer in
                                                (GraphAttentionLayer, GATv2Layer, ConstantAttentionLayer)}
