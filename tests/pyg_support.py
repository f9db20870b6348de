"""PyTorch Geometric's layers holding this project's weights, for the tests that compare the two."""

from __future__ import annotations

import torch

from gat.layers import GATv2Layer


def pyg_gatv2(layer: GATv2Layer, replica: int, f_in: int):
    """PyG's GATv2Conv (its defaults: separate lin_l and lin_r with biases, self-loops) with `layer`'s weights."""
    from torch_geometric.nn import GATv2Conv

    H, F_out = layer.n_heads, layer.n_hidden
    conv = GATv2Conv(f_in, F_out, heads=H, concat=layer.is_concat, negative_slope=layer.negative_slope,
                     dropout=0.0, add_self_loops=True, bias=True, share_weights=False).eval()
    with torch.no_grad():
        conv.lin_l.weight.copy_(layer.W[replica].transpose(1, 2).reshape(H * F_out, f_in))
        conv.lin_r.weight.copy_(layer.W_target[replica].transpose(1, 2).reshape(H * F_out, f_in))
        conv.lin_l.bias.copy_(layer.b_source[replica].reshape(-1))
        conv.lin_r.bias.copy_(layer.b_target[replica].reshape(-1))
        conv.att.copy_(layer.a[replica].view(1, H, F_out))
        # PyG adds one bias after joining the heads; ours adds one per head.
        conv.bias.copy_(layer.bias[replica].reshape(-1) if layer.is_concat else layer.bias[replica].mean(0))
    return conv
