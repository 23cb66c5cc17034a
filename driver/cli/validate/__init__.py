"""`gpu-dra validate`: claim and class checks, selector explanations, CEL cost, capacity."""
