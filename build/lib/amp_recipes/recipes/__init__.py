"""The recipes, shipped inside the package as `amp_recipes.recipes` for `amp-recipes ls/cp`."""
