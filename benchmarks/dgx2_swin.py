"""Entry file for the DGX-2 comparison (benchmarks/bench_dgx2.py): a Swin-Transformer-like vision model at
Swin-H's depths and the nnScaler artifact's image and window sizes. Written here, not transformers' Swin:
window attention without the shifted windows' roll and mask and without the relative position bias (they
change neither the matmul shapes nor the attention scores' size that co-shard is about); the patch embedding
is a reshape and a Linear (see Swin.__init__). Sizes:
- depths (2, 2, 18, 2): SwinV2-H's (Liu et al., CVPR 2022, Table 1);
- widths C = 512 x (1, 2, 4, 8) with heads of 32 channels (16, 32, 64, 128 heads): Swin-H's C = 352 is 11
  heads of 32 in its first stage, which no tensor-parallel size divides; 512 is SwinV2-G's C;
- image 1536, patch 4, window 48 (2304 tokens per window), global batch 256: the nnScaler artifact's Swin
  runs (microsoft/nnscaler cupilot/evaluation/swin_32gpus.sh: --img-size 1536 --window-size 48, GBS=256).
Traced on fake tensors only.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGE, PATCH, WINDOW, WIDTH, DEPTHS, HEAD_DIM, CLASSES, BATCH = 1536, 4, 48, 512, (2, 2, 18, 2), 32, 1000, 256


class WindowAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):                      # (windows of all images, tokens of a window, C)
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class SwinBlock(nn.Module):
    def __init__(self, dim, heads, window):
        super().__init__()
        self.window = window
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):                      # (B, H, W, C)
        B, H, W, C = x.shape
        w = self.window
        windows = self.norm1(x).view(B, H // w, w, W // w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, C)
        y = self.attn(windows).view(B, H // w, W // w, w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)
        x = x + y
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PatchMerging(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
        B, H, W, C = x.shape
        x = x.view(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).reshape(B, H // 2, W // 2, 4 * C)
        return self.reduction(self.norm(x))


class Swin(nn.Module):
    def __init__(self, width=WIDTH, depths=DEPTHS, window=WINDOW, classes=CLASSES):
        super().__init__()
        # the patch embedding as a Linear over each 4x4x3 patch: the same as Conv2d(3, width, 4, stride=4),
        # which the cost model prices at 4.4e18 FLOPs at this size (node_flops multiplies every dim of the
        # conv's annotation: input and output pixels both; the true figure is 1.9e12)
        self.patch = nn.Linear(3 * PATCH * PATCH, width)
        blocks = []
        for stage, depth in enumerate(depths):
            dim = width * 2 ** stage
            if stage:
                blocks.append(PatchMerging(dim // 2))
            blocks += [SwinBlock(dim, dim // HEAD_DIM, window) for _ in range(depth)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(width * 2 ** (len(depths) - 1))
        self.head = nn.Linear(width * 2 ** (len(depths) - 1), classes)

    def forward(self, images, labels):
        B, _, H, W = images.shape
        patches = images.view(B, 3, H // PATCH, PATCH, W // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
        x = self.patch(patches.reshape(B, H // PATCH, W // PATCH, 3 * PATCH * PATCH))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x).mean(dim=(1, 2)))
        return F.cross_entropy(logits, labels)


def build():
    return Swin()


def example_inputs():
    return torch.randn(BATCH, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (BATCH,))
