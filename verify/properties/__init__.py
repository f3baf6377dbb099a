"""Properties: the checks that turn runs of a case into verdicts (differential, metamorphic, peers,
status), what a case should give (R and B) and the verdict record."""
