"""Entry file for the DGX-2 comparison (benchmarks/bench_dgx2.py): benchmarks/dgx2_alphafold2.py at AlphaFold2's
fine-tuning sizes (Jumper et al. 2021, Suppl. 1.11, Table 4, fine-tuning: crop N_res 384, N_clust 512 MSA
sequences, N_extra_seq 5120 extra sequences), the rest as there: 48 Evoformer blocks, c_m 256, c_z 128, 4 extra-MSA
blocks, 3 recycling passes, global batch 128. nnScaler's own AlphaFold2 example lists 512 x 384 (MSA rows x
residues) among its fine-tuning sizes (msrasys/nnscaler examples/alphafold2/alphafold2.py `test`).
Traced on fake tensors only.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dgx2_alphafold2 import AMINO_ACIDS, BATCH, DISTANCE_BINS, build  # noqa: E402,F401

SEQUENCES, RESIDUES, EXTRA_SEQUENCES = 512, 384, 5120


def example_inputs():
    return {"msa": torch.randint(0, AMINO_ACIDS, (BATCH, SEQUENCES, RESIDUES)),
            "distances": torch.randint(0, DISTANCE_BINS, (BATCH, RESIDUES, RESIDUES)),
            "extra_msa": torch.randint(0, AMINO_ACIDS, (BATCH, EXTRA_SEQUENCES, RESIDUES))}
