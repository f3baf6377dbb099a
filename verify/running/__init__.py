"""Running the engine: the function API, campaigns, profiles, planted bugs and the self-test."""
