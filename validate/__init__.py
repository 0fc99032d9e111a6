"""oscar.validate: synthetic regimes, scheme zoo, metrics, statistical tests, NIAH/RULER, perplexity."""
