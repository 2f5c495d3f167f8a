"""Response-length predictors: the prompt-only ones, the remaining-length probe, self-prediction and the
length labels they are fitted on."""
