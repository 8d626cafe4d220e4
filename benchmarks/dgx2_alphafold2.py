"""Entry file for the DGX-2 comparison (benchmarks/bench_dgx2.py): the Evoformer trunk of fixtures/evoformer.py
at AlphaFold2's published sizes (Jumper et al. 2021, Suppl. 1.5-1.7, 1.11 and Table 4, initial training): 48
Evoformer blocks, MSA channels c_m 256, pair channels c_z 128, 8 heads of 32 in the MSA attentions, outer-product-mean
hidden 32 (the fixture uses one c_hidden for it and the triangle multiplications, whose published width is 128:
32 here), triangle attention around the starting and the ending node with 4 heads of 32, 128 MSA sequences (the
clusters), 256 residues (the crop), 3 recycling passes (N_cycle = 3: two without gradient), global batch 128 (one
protein per TPU core); and the extra-MSA stack, run in every cycle before the Evoformer blocks: 1024 extra
sequences embedded to c_e 64, 4 extra-MSA blocks with row attention and global column attention of 8 heads of 8.
The fixture has no templates or structure module, and embeds sequence ids only (no deletion or profile features).
nnScaler's own AlphaFold2 example lists the same initial-training sizes (msrasys/nnscaler
examples/alphafold2/alphafold2.py `test`: s, r = 128, 256; extra sequences 1024 x 256); the crop its OSDI '24
evaluation used: not found.
Traced on fake tensors only:
    nnscaler-rewrite schedule benchmarks/dgx2_alphafold2.py --pp 4 --micro-batches 16 --schedule 3f1b
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from evoformer import AMINO_ACIDS, DISTANCE_BINS, Evoformer  # noqa: E402

BLOCKS, C_M, C_Z, HEADS, C_HEAD, C_HIDDEN, SEQUENCES, RESIDUES, BATCH, RECYCLES = 48, 256, 128, 8, 32, 32, 128, 256, 128, 3
TRI_HEADS, TRI_C_HEAD = 4, 32
EXTRA_BLOCKS, EXTRA_SEQUENCES, C_E, EXTRA_HEADS, EXTRA_C_HEAD = 4, 1024, 64, 8, 8


def build():
    return Evoformer(c_m=C_M, c_z=C_Z, heads=HEADS, c_head=C_HEAD, c_hidden=C_HIDDEN, blocks=BLOCKS, recycles=RECYCLES,
                     max_relpos=32, tri_heads=TRI_HEADS, tri_c_head=TRI_C_HEAD, extra_blocks=EXTRA_BLOCKS, c_e=C_E,
                     extra_heads=EXTRA_HEADS, extra_c_head=EXTRA_C_HEAD)


def example_inputs():
    return {"msa": torch.randint(0, AMINO_ACIDS, (BATCH, SEQUENCES, RESIDUES)),
            "distances": torch.randint(0, DISTANCE_BINS, (BATCH, RESIDUES, RESIDUES)),
            "extra_msa": torch.randint(0, AMINO_ACIDS, (BATCH, EXTRA_SEQUENCES, RESIDUES))}
