"""Text: where the calibration and evaluation text come from.

    text            C4 calibration documents and the evaluation windows (WikiText-2, held-out C4), found offline
    calib_sources   the calibration sources a run can score on (--calib-source: C4, the own text, the mixture)
    tokenize_docs   calibration documents to token ids in bounded memory"""
