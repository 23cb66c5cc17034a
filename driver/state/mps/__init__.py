"""MPS for prepared claims: each claim's control daemon and its limits."""
