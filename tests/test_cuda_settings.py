"""The CUDA kernels' environment settings: a value the kernels cannot take stops the
engine at start with a message naming the setting, not a failed build mid-request.
(Plain parsing: runs anywhere.)"""

from __future__ import annotations

import pytest

from vlm_serve.engine.decode import cuda_attention, cuda_norms


def test_the_decode_split_takes_chunks_its_warps_share_evenly():
    assert cuda_attention.decode_split("128,4") == (128, 4)
    assert cuda_attention.decode_split("256, 8") == (256, 8)
    for bad in ("128", "100,8", "64,0", "4096,64", "a,b", ""):
        with pytest.raises(ValueError, match="VLM_SERVE_DECODE_SPLIT"):
            cuda_attention.decode_split(bad)


def test_the_add_norm_form_is_one_of_its_forms():
    bodies = [cuda_norms.source(form) for form in cuda_norms.FORMS]
    assert len(set(bodies)) == len(cuda_norms.FORMS) and cuda_norms.FORM in cuda_norms.FORMS
    with pytest.raises(ValueError, match="VLM_SERVE_ADD_NORM"):
        cuda_norms.source("fast")
