"""Results: failure artifacts, their replay, the regression corpus, and campaign reports."""
