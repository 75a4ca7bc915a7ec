"""Tasks and their data: `classification` (GLUE and your own files), `ner`, extractive `qa` and
masked LM (`mlm`); where their files come from (`files`), what every task shares between its
tokenised data and the loop (`batches`), and the `evaluate` metrics shipped with the package
(`metrics`)."""
