"""The built-in conversion methods' ``retrofit convert`` flags, so that ``--help`` imports no torch.

Generated from the method configs by :func:`retrofit.cli.convert.method_flag_table`; a test checks
that it still matches them. Regenerate after changing a method's config fields::

    python -c "import pprint; from retrofit.cli.convert import method_flag_table; pprint.pp(method_flag_table(), width=110)"
"""

TABLE: dict[str, dict] = {'window': {'flag': '--window',
            'kind': 'int',
            'nullable': True,
            'help': "sliding window w in tokens (default 128, or the family's native window with --layers "
                    'global) [macchiato: None, delta: None, hedgehog: None, lavo: None]'},
 'latents': {'flag': '--latents',
             'kind': 'int',
             'nullable': False,
             'help': 'latent states L in total over the query heads (L / heads per head) [macchiato: 128]'},
 'init_swa_share': {'flag': '--init-swa-share',
                    'kind': 'float',
                    'nullable': False,
                    'help': 'initial sliding-window share p(0|t) in (0, 1] (1 = latent path closed) '
                            '[macchiato: 0.9, delta: 0.98]'},
 'conv_size': {'flag': '--conv-size',
               'kind': 'int',
               'nullable': False,
               'help': 'causal depthwise conv size before the latent projections (0 or 1 = none) [macchiato: '
                       '0]'},
 'sinks': {'flag': '--sinks',
           'kind': 'int',
           'nullable': False,
           'help': 'attention sinks: the window branch also sees the first n tokens [macchiato: 0, delta: 0, '
                   'hedgehog: 0]'},
 'sink_distance': {'flag': '--sink-distance',
                   'kind': 'int',
                   'nullable': True,
                   'help': 'cap on the RoPE distance a query sees to a sink (StreamingLLM-style '
                           "re-positioning; default the base's max_position_embeddings - 1, so nothing "
                           'changes inside its context; 0 = no cap) [macchiato: None, delta: None, hedgehog: '
                           'None]'},
 'chunk_size': {'flag': '--chunk-size',
                'kind': 'int',
                'nullable': False,
                'help': 'chunk length of the chunkwise-parallel scan over the new state [macchiato: 64, '
                        'delta: 64, exp-linear: 64, hedgehog: 64]'},
 'memory_half_life': {'flag': '--memory-half-life',
                      'kind': 'int',
                      'nullable': False,
                      'help': "tokens over which a stored value halves at conversion (the decay gate's "
                              'initial bias; 0 = no decay) [delta: 4096]'},
 'features': {'flag': '--features',
              'kind': 'int',
              'nullable': False,
              'help': 'f: each Hedgehog feature map has 2 f features (softmax(Wx) and softmax(-Wx)) '
                      '[hedgehog: 128]'},
 'init_log_scale': {'flag': '--init-log-scale',
                    'kind': 'float',
                    'nullable': False,
                    'help': "initial log-factor between the read's mass and the softmax's beyond the window "
                            "(memory_scale's bias) [hedgehog: 2.0]"},
 'memory_distance': {'flag': '--memory-distance',
                     'kind': 'int',
                     'nullable': True,
                     'help': 'score every key beyond the window as if exactly this many tokens before its '
                             'query (RoPE distance): the read then depends on no position and holds past the '
                             'lengths it was fitted or trained on (None: true distances) [hedgehog: None]'},
 'tier': {'flag': '--tier',
          'kind': 'int',
          'nullable': False,
          'help': 'exact tier: tokens per KV head kept exactly, read by the pretrained softmax beside the '
                  'window, chosen among those leaving it (0 = none: every older token goes to the read) '
                  '[hedgehog: 0]'},
 'tier_rule': {'flag': '--tier-rule',
               'kind': 'str',
               'nullable': False,
               'help': "how the tier's tokens are chosen: recall (the read's self-recall error, LoLA), norm "
                       '(key norm) or recency (the newest: a longer window) [hedgehog: recall]'},
 'tier_block': {'flag': '--tier-block',
                'kind': 'int',
                'nullable': False,
                'help': 'tokens settled into the tier or the read at a time (the window then holds w to w + '
                        'tier_block - 1 tokens) [hedgehog: 64]'},
 'retrieve': {'flag': '--retrieve',
              'kind': 'int',
              'nullable': False,
              'help': 'block retrieval: every settled block of tier_block tokens is kept, and each query '
                      'reads this many of them exactly, those whose keys bound its score highest (0 = off; '
                      'the cache then grows with the context; replaces the tier) [hedgehog: 0]'},
 'retrieve_score': {'flag': '--retrieve-score',
                    'kind': 'str',
                    'nullable': False,
                    'help': 'how a query ranks the stored blocks: max (its best score in the block) or bound '
                            "(Quest's bound from the block's key extremes: cheaper, looser) [hedgehog: max]"},
 'bases': {'flag': '--bases',
           'kind': 'int',
           'nullable': True,
           'help': 'orthonormal bases r per head (default min(64, head_dim)) [lavo: None]'},
 'global_weight': {'flag': '--global-weight',
                   'kind': 'float',
                   'nullable': False,
                   'help': 'initial g of out = (1-g) local + g global (the paper averages: 0.5) [lavo: 0.5]'},
 'learn_global_weight': {'flag': '--learn-global-weight',
                         'kind': 'bool',
                         'nullable': False,
                         'help': 'train g (off: g stays fixed) [lavo: True]'},
 'relative_bias': {'flag': '--relative-bias',
                   'kind': 'bool',
                   'nullable': False,
                   'help': "the paper's relative position bias on the local branch [lavo: True]"},
 'dissect': {'flag': '--dissect',
             'kind': 'bool',
             'nullable': False,
             'help': "memory of the complete windows before the query's own (paper 3.2); off = eq. 4 [lavo: "
                     'True]'},
 'memory_scaling': {'flag': '--memory-scaling',
                    'kind': 'float',
                    'nullable': True,
                    'help': 'read temperature of the memory (default: the pretrained scaling) [lavo: None]'},
 'segment': {'flag': '--segment',
             'kind': 'int',
             'nullable': False,
             'help': 'segment s in tokens: queries see their own half-segment of s/2 and the previous one '
                     '[llp: 512]'}}
