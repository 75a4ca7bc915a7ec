"""Small helpers shared by the mixed-precision fine-tuning recipes in `recipes/`.

Plain functions and small classes only: the training loop and the `Accelerator`
stay visible in each recipe.
"""

__version__ = "0.1.0"
