"""What a deployment is: recipes, inventories, the plan, and the files they come from."""
