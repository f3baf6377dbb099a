"""Cases: the frozen `CaseSpec`, the tensors built from it, and the Hypothesis strategies."""
