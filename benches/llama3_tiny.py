"""A Llama-3-style random model for side-by-side speed runs with llama.cpp
(docs/models.md): 8 layers, hidden 1024, GQA 16/4, SwiGLU 3584, rope base
500000 with Llama 3.1 scaling factors in `rope_freqs.weight`, a 32k
vocabulary; F16, to be requantized with `specd quantize --type q4_k_m`.

    pip install gguf numpy
    python3 benches/llama3_tiny.py /tmp/llama3-tiny-f16.gguf
    specd quantize --model /tmp/llama3-tiny-f16.gguf --type q4_k_m --out /tmp/llama3-tiny-q4km.gguf
    specd bench-model --model /tmp/llama3-tiny-q4km.gguf --prefill 128 --decode 64
    llama-bench -m /tmp/llama3-tiny-q4km.gguf -t 2 -p 128 -n 64
"""
import sys

import numpy as np, gguf
rng=np.random.default_rng(0)
V,H,L,NH,NKV,FF=32000,1024,8,16,4,3584
HD=H//NH
w=gguf.GGUFWriter(sys.argv[1] if len(sys.argv) > 1 else 'llama3-tiny-f16.gguf','llama')
w.add_context_length(8192); w.add_embedding_length(H); w.add_block_count(L)
w.add_feed_forward_length(FF); w.add_head_count(NH); w.add_head_count_kv(NKV)
w.add_rope_dimension_count(HD); w.add_rope_freq_base(500000.0)
w.add_layer_norm_rms_eps(1e-5); w.add_file_type(1)
w.add_tokenizer_model('gpt2'); w.add_tokenizer_pre('llama-bpe')
toks=[f't{i}' for i in range(V)]
w.add_token_list(toks); w.add_token_types([1]*V)
w.add_token_merges(['t 0','t 1'])
w.add_bos_token_id(1); w.add_eos_token_id(2)
def t(name, shape, scale=0.02, dt=np.float16):
    w.add_tensor(name, (rng.standard_normal(shape)*scale).astype(dt))
t('token_embd.weight',(V,H))
# llama3 rope factors (factor 8, low 1, high 4, original 8192)
import math
freqs=[]
for i in range(HD//2):
    f=1/500000**(2*i/HD); wl=2*math.pi/f
    if wl<8192/4: freqs.append(1.0)
    elif wl>8192/1: freqs.append(8.0)
    else:
        s=(8192/wl-1)/(4-1); freqs.append(1/((1-s)/8+s))
w.add_tensor('rope_freqs.weight',np.array(freqs,dtype=np.float32))
for l in range(L):
    p=f'blk.{l}'
    w.add_tensor(f'{p}.attn_norm.weight',np.ones(H,dtype=np.float32))
    w.add_tensor(f'{p}.ffn_norm.weight',np.ones(H,dtype=np.float32))
    t(f'{p}.attn_q.weight',(H,H)); t(f'{p}.attn_k.weight',(NKV*HD,H)); t(f'{p}.attn_v.weight',(NKV*HD,H))
    t(f'{p}.attn_output.weight',(H,H)); t(f'{p}.ffn_gate.weight',(FF,H)); t(f'{p}.ffn_up.weight',(FF,H)); t(f'{p}.ffn_down.weight',(H,FF))
w.add_tensor('output_norm.weight',np.ones(H,dtype=np.float32))
t('output.weight',(V,H))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
