"""Vision Transformer (Dosovitskiy et al., 2021, "An Image is Worth 16x16 Words").

    patches = split(image) into N = (image_size / P)² squares of P×P pixels
    x_0 = [cls; patches · W_patch + b] + pos          (B, N + 1, E)
    x_L = blocks(x_0)                                  bidirectional, pre-norm
    logits = head(norm_f(x_L)[:, 0])                   the class token's final state

The patch projection is a ``Conv2d`` with ``kernel_size = stride = P``: each output position is
the dot product of one patch with each filter, i.e. a linear map of the flattened patch
``(C·P·P,)`` with ``W_patch = conv.weight.view(E, C·P·P)`` (:meth:`ViT.patchify` flattens in
that order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.models.config import ACTIVATIONS, NORM_PLACEMENTS, ConfigBase
from qkv.models.parts import ModelBase, init_gpt_style
from qkv.nn.block import TransformerBlock
from qkv.nn.norms import make_norm
from qkv.nn.positions import LearnedPositionalEmbedding

__all__ = ["ViT", "ViTConfig"]


@dataclass(frozen=True)
class ViTConfig(ConfigBase):
    """Configuration of a :class:`ViT`.

    Attributes:
        image_size: height and width of the (square) input images, a multiple of
            ``patch_size``.
        patch_size: ``P``, side of each square patch.
        channels: ``C`` (3 for RGB).
        num_classes: outputs of the classification head.
        d_model: model width ``E``; a multiple of ``num_heads``.
        num_layers: transformer blocks.
        num_heads: attention heads ``H``.
        d_ff: feed-forward hidden width; None = ``4·E``.
        dropout: on the embeddings, attention weights, feed-forward hidden, residual branches.
        norm: ``"pre"`` (ViT) or ``"post"``.
        activation: feed-forward kind (``"gelu"`` in ViT).
        norm_eps: LayerNorm epsilon (1e-6 in ViT).
    """

    image_size: int = 32
    patch_size: int = 4
    channels: int = 3
    num_classes: int = 10
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    d_ff: int | None = None
    dropout: float = 0.0
    norm: str = "pre"
    activation: str = "gelu"
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "channels", "num_classes", "d_model",
                     "num_layers", "num_heads"):
            self._int(name)
        self._int("d_ff", optional=True)
        if self.image_size % self.patch_size:
            raise ValueError(
                f"ViTConfig.image_size ({self.image_size}) must be a multiple of patch_size "
                f"({self.patch_size})"
            )
        self._heads(self.d_model, self.num_heads)
        self._float("dropout", low=0.0, high=1.0)
        self._float("norm_eps", low=0.0)
        self._choice("norm", NORM_PLACEMENTS)
        self._choice("activation", ACTIVATIONS)

    @property
    def num_patches(self) -> int:
        """``N = (image_size / patch_size)²``."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def ffn_dim(self) -> int:
        """Feed-forward hidden width (``d_ff`` or ``4·d_model``)."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff


class ViT(ModelBase):
    """Image classifier: patches as tokens, a class token, learned positions, a transformer.

    Args:
        config: a :class:`ViTConfig`.

    Submodules and parameters: ``patch_embed`` (``Conv2d(C, E, P, stride=P)``), ``cls_token``
    (parameter ``(1, 1, E)``), ``pos`` (``LearnedPositionalEmbedding(N + 1, E)``), ``drop``,
    ``blocks`` (``nn.ModuleList`` of :class:`~qkv.nn.TransformerBlock`), ``norm_f`` (final
    LayerNorm, pre-norm only, else None), ``head`` (``nn.Linear(E, num_classes)``).

    Raises:
        TypeError: ``config`` is not a :class:`ViTConfig`.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        if not isinstance(config, ViTConfig):
            raise TypeError(f"config must be a ViTConfig, got {type(config).__name__}")
        self.config = c = config
        P = c.patch_size
        self.patch_embed = nn.Conv2d(c.channels, c.d_model, kernel_size=P, stride=P)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.d_model))
        self.pos = LearnedPositionalEmbedding(c.num_patches + 1, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                c.d_model, c.num_heads, c.ffn_dim, dropout=c.dropout, activation=c.activation,
                norm=c.norm, norm_eps=c.norm_eps,
            )
            for _ in range(c.num_layers)
        )
        self.norm_f = (
            make_norm("layernorm", c.d_model, eps=c.norm_eps) if c.norm == "pre" else None
        )
        self.head = nn.Linear(c.d_model, c.num_classes)
        init_gpt_style(self, c.num_layers)
        nn.init.normal_(self.cls_token, std=0.02)

    def _check_images(self, images: object) -> Tensor:
        c = self.config
        expected = (c.channels, c.image_size, c.image_size)
        if not isinstance(images, Tensor) or not images.is_floating_point():
            raise TypeError(
                f"images must be a floating-point tensor (B, C, H, W), got {images!r:.60}"
            )
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"images must have shape (B, C, H, W) = (B, {', '.join(map(str, expected))}), "
                f"got {tuple(images.shape)}"
            )
        return images

    def patchify(self, images: Tensor) -> Tensor:
        """Flattened patches ``(B, N, C·P·P)`` in row-major patch order, each patch flattened
        as ``(C, P, P)`` (the layout of ``patch_embed.weight``).

        Raises:
            TypeError, ValueError: images not ``(B, C, image_size, image_size)`` floats.
        """
        x = self._check_images(images)
        B, C, H, W = x.shape
        P = self.config.patch_size
        x = x.reshape(B, C, H // P, P, W // P, P)  # (B, C, h, P, w, P)
        x = x.permute(0, 2, 4, 1, 3, 5)  # (B, h, w, C, P, P)
        return x.reshape(B, (H // P) * (W // P), C * P * P)  # (B, N, C·P·P)

    def embed_patches(self, images: Tensor) -> Tensor:
        """Patch embeddings ``(B, N, E)`` (no class token, no positions).

        Raises:
            TypeError, ValueError: as :meth:`patchify`.
        """
        x = self.patch_embed(self._check_images(images))  # (B, E, h, w)
        return x.flatten(2).transpose(1, 2)  # (B, N, E)

    def forward(self, images: Tensor) -> Tensor:
        """Class logits.

        Args:
            images: ``(B, C, image_size, image_size)`` floats.

        Returns:
            ``(B, num_classes)``.

        Raises:
            TypeError, ValueError: images of the wrong type or shape.
        """
        x = self.embed_patches(images)  # (B, N, E)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, E)
        x = self.drop(self.pos(torch.cat([cls, x], dim=1)))  # (B, N + 1, E)
        for block in self.blocks:
            x = block(x)  # (B, N + 1, E)
        if self.norm_f is not None:
            x = self.norm_f(x)
        return self.head(x[:, 0])  # (B, num_classes)
