"""The toy family's model: Llama 3's blocks under other module names."""

from __future__ import annotations

import math

import torch
from torch import nn

from meshloom.models.common.attention import GroupedQueryAttention
from meshloom.models.common.feed_forward import FeedForward
from meshloom.models.common.init import trunc_normal_
from meshloom.models.common.norm import RMSNorm
from meshloom.models.common.rope import rope_tables
from meshloom.models.llama3.model import Llama3Args


class Block(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.ln_1 = RMSNorm(args.dim, args.norm_eps)
        self.attn = GroupedQueryAttention(args.dim, args.n_heads, args.kv_heads, args.head_dim)
        self.ln_2 = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x, cos, sin, document_ids=None):
        x = x + self.attn(self.ln_1(x), cos, sin, document_ids=document_ids)
        return x + self.mlp(self.ln_2(x))


class ToyModel(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.args = args
        self.wte: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.ln_f: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        shape = (args.max_seq_len, args.head_dim // 2)
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)
        if not self.cos.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, None, self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        out_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for block in self.layers.values():
            for norm in (block.ln_1, block.ln_2):
                norm.init_weights()
            block.attn.init_weights(0.02, out_std)
            block.mlp.init_weights(0.02, out_std)
        if self.wte is not None:
            nn.init.normal_(self.wte.weight)
        if self.ln_f is not None:
            self.ln_f.init_weights()
        if self.lm_head is not None:
            trunc_normal_(self.lm_head.weight, self.args.dim**-0.5)

    def forward(self, tokens, document_ids=None, positions=None):
        cos, sin = (self.cos, self.sin) if positions is None else (self.cos[positions], self.sin[positions])
        h = self.wte(tokens) if self.wte is not None else tokens
        for block in self.layers.values():
            h = block(h, cos, sin, document_ids=document_ids)
        if self.ln_f is not None:
            h = self.ln_f(h)
        return self.lm_head(h).float() if self.lm_head is not None else h

    def num_params(self, exclude_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        return total - (self.wte.weight.numel() if exclude_embedding and self.wte is not None else 0)
