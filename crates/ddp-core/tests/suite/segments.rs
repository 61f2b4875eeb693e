//! Activation checkpointing on backward segments (`segments::checkpoint`): a block run without keeping its
//! activations and recomputed at the backward pass gives the plain backward's gradients bit for bit (the same ops
//! on the same values), for every parameter before, inside and after the checkpointed blocks; outside a recording
//! it is the block's forward.

use crate::common::wave;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, VarBuilder, VarMap};
use ddp_core::segments;

fn layers(varmap: &VarMap) -> Vec<candle_nn::Linear> {
    let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
    (0..4).map(|i| linear(6, 6, vb.pp(format!("l{i}"))).unwrap()).collect()
}

/// Each parameter's gradient bits, by name, from `grad_of`.
fn gradients(varmap: &VarMap, grad_of: impl Fn(&Tensor) -> Option<Tensor>) -> Vec<Vec<u32>> {
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let g = grad_of(data[n].as_tensor()).expect("every parameter has a gradient");
            g.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
        })
        .collect()
}

#[test]
fn checkpointed_blocks_give_the_plain_gradients_bit_for_bit() {
    let varmap = VarMap::new();
    let ls = layers(&varmap);
    let x = wave(0.3, &[5, 6], 1.0);
    let forward = |checkpointed: bool| -> candle_core::Result<Tensor> {
        let mut h = ls[0].forward(&x)?.tanh()?;
        for l in &ls[1..3] {
            let l = l.clone();
            h = if checkpointed {
                segments::checkpoint(&h, move |h| l.forward(h)?.tanh())?
            } else {
                l.forward(&h)?.tanh()?
            };
        }
        ls[3].forward(&h)?.sqr()?.sum_all()
    };
    let store = forward(false).unwrap().backward().unwrap();
    let plain = gradients(&varmap, |t| store.get(t).cloned());
    let (loss, cuts) = segments::record(|| forward(true)).unwrap();
    assert_eq!(cuts.num_cuts(), 3, "two checkpointed blocks: a cut before the first, one after each");
    // The segments' gradients summed per parameter (by tensor id).
    let mut merged: std::collections::HashMap<candle_core::TensorId, Tensor> = Default::default();
    let data = varmap.data().lock().unwrap().clone();
    cuts.backward(&loss, |_, mut store| -> ddp_core::Result<()> {
        for v in data.values() {
            if let Some(g) = store.remove(v.as_tensor()) {
                let g = match merged.remove(&v.as_tensor().id()) {
                    Some(acc) => (acc + g)?,
                    None => g,
                };
                merged.insert(v.as_tensor().id(), g);
            }
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(gradients(&varmap, |t| merged.get(&t.id()).cloned()), plain);
    // Outside a recording: the block's forward, no cut.
    let y = segments::checkpoint(&x, |x| x.affine(2.0, 0.0)).unwrap();
    assert_eq!(y.to_vec2::<f32>().unwrap(), (&x * 2.0).unwrap().to_vec2::<f32>().unwrap());
}
