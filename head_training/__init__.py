"""Training the draft head (draft_head/head.py) by self-distillation: ``python -m
head_training.train``.

An application, not a copied folder: it uses the model loader and the command-line helpers. This
package imports nothing, so the trainer can load a fast BLAS before ``mlx.core`` (fast_blas.py).
"""
