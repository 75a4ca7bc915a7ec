"""The minimal tier: one device, AMP written by hand (`amp-recipes cp minimal/bert_glue`)."""
