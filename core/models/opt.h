// core/models: the OPT family (OPTForCausalLM): learned positions offset by 2, LayerNorm before
// (opt-125m, opt-1.3b and up) or after (opt-350m) each block, ReLU FFN, biases everywhere, the LM
// head tied to the token embedding, and for opt-350m an embedding narrower than the model
// (project_in / project_out). Tensor names start with "model.decoder."; config.json variants this
// engine would compute wrong (activations other than ReLU, no biases, LayerNorm without
// parameters, an untied LM head) are refused naming the key.
#pragma once

#include "core/model_family.h"

namespace infinigen {

const ModelFamily& opt_family();

}  // namespace infinigen
