"""Training data: documents from a streamed hub dataset or local files (``sources``), tokenised and
packed into fixed-length sequences with an EOS between documents, resumably (``packing``)."""
