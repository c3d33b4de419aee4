"""Method tests need ``lavo`` and ``llp`` in the surgery registry before any ConversionSpec is built."""
from retrofit.layers import lavo, llp

lavo.register()
llp.register()
