"""Stage 2: run the model once and attribute every torch call to its source site."""
