//! [`FaultInjecting`]: a simulated pool's backend, which fails as the faults injected into its
//! device say (`POST /admin/sim/{device}`), beside the simulated device itself
//! ([`super::simulated`]).

use std::sync::Arc;

use super::simulated::SimulatedDevice;
use crate::core::backend::{
    ArenaStats, Arenas, Backend, BackendError, DecodeStep, Generations, Interrupts, Liveness, Residency, RunMeta,
};
use crate::core::tensor::{Tensor, TensorView};

/// A simulated pool's backend: runs on the capped arena, and fails when a fault is injected
/// into its device (`POST /admin/sim/{device}` with `fail_next` or `driver_reset`). It wraps an
/// in-process ONNX Runtime backend and has each capability the wrapped one has: runs, prompts
/// and steps fail as injected, loads are checked against the device's capacity, statistics
/// leave the simulated pressure out; liveness and interrupts are the wrapped backend's.
pub struct FaultInjecting {
    inner: Box<dyn Backend>,
    device: Arc<SimulatedDevice>,
    /// The arena's statistics at the last refresh, the pressure of that moment taken out.
    stats: Option<ArenaStats>,
}

impl FaultInjecting {
    /// Wrap `inner`, which runs on `device`.
    pub fn new(inner: Box<dyn Backend>, device: Arc<SimulatedDevice>) -> Self {
        let mut wrapped = Self {
            inner,
            device,
            stats: None,
        };
        wrapped.keep_stats();
        wrapped
    }

    /// `run` on the wrapped backend, unless the device has a failure injected for this run.
    fn unless_injected<T>(
        &mut self,
        run: impl FnOnce(&mut Box<dyn Backend>) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        match self.device.injected_failure() {
            Some(error) => Err(error),
            None => run(&mut self.inner),
        }
    }

    fn keep_stats(&mut self) {
        self.stats = self
            .inner
            .arenas()
            .and_then(|arenas| arenas.arena_stats())
            .map(|s| self.device.ours(s, self.device.pressure()));
    }
}

impl Backend for FaultInjecting {
    fn run(
        &mut self,
        model: &str,
        inputs: Vec<Tensor>,
        outputs: &[String],
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        self.unless_injected(|inner| inner.run(model, inputs, outputs, meta))
    }

    fn run_views(
        &mut self,
        model: &str,
        inputs: &[TensorView<'_>],
        outputs: &[String],
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        self.unless_injected(|inner| inner.run_views(model, inputs, outputs, meta))
    }

    fn run_borrowed(
        &mut self,
        model: &str,
        inputs: &[Tensor],
        outputs: &[String],
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        self.unless_injected(|inner| inner.run_borrowed(model, inputs, outputs, meta))
    }

    /// Loads checked against the device's capacity.
    fn residency(&mut self) -> Option<&mut dyn Residency> {
        self.inner.residency()?;
        Some(self)
    }

    /// Prompts and steps fail as injected, as runs do.
    fn generations(&mut self) -> Option<&mut dyn Generations> {
        self.inner.generations()?;
        Some(self)
    }

    /// Statistics without the simulated pressure.
    fn arenas(&mut self) -> Option<&mut dyn Arenas> {
        self.inner.arenas()?;
        Some(self)
    }

    /// No fault is injected into liveness: the wrapped backend's.
    fn liveness(&self) -> Option<&dyn Liveness> {
        self.inner.liveness()
    }

    /// A stop ends the wrapped backend's run: its interrupts.
    fn interrupts(&mut self) -> Option<&mut dyn Interrupts> {
        self.inner.interrupts()
    }
}

impl Generations for FaultInjecting {
    fn prefill(
        &mut self,
        model: &str,
        seq: u64,
        inputs: Vec<Tensor>,
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        self.unless_injected(|inner| inner.caches()?.prefill(model, seq, inputs, meta))
    }

    fn prefill_many(
        &mut self,
        model: &str,
        seqs: &[u64],
        inputs: Vec<Tensor>,
        meta: &RunMeta,
    ) -> Result<Vec<Tensor>, BackendError> {
        self.unless_injected(|inner| inner.caches()?.prefill_many(model, seqs, inputs, meta))
    }

    fn decode(&mut self, model: &str, step: &DecodeStep, meta: &RunMeta) -> Result<Vec<Tensor>, BackendError> {
        // A step that only drops caches runs nothing on the device: no injected fault is
        // spent on it.
        if step.rows.is_empty() {
            return self.inner.caches()?.decode(model, step, meta);
        }
        self.unless_injected(|inner| inner.caches()?.decode(model, step, meta))
    }
}

impl Arenas for FaultInjecting {
    fn arena_stats(&self) -> Option<ArenaStats> {
        self.stats
    }

    /// The device's one arena, which every session shares and the wrapped backend reads once:
    /// what it holds is what its runs are measured in, the pressure left out.
    fn held_arena_stats(&self) -> Option<ArenaStats> {
        self.stats
    }

    fn refresh_arena_stats(&mut self) {
        if let Some(arenas) = self.inner.arenas() {
            arenas.refresh_arena_stats();
        }
        self.keep_stats();
    }

    fn refresh_arena_stats_for(&mut self, model: &str) {
        if let Some(arenas) = self.inner.arenas() {
            arenas.refresh_arena_stats_for(model);
        }
        self.keep_stats();
    }
}

impl Residency for FaultInjecting {
    fn load_model(&mut self, name: &str, model: crate::core::model::ModelData<'_>) -> Result<(), String> {
        self.inner.loader(name)?.load_model(name, model)?;
        self.device
            .check_capacity(&format!("loading `{name}`"))
            .inspect_err(|_| self.unload_model(name))
    }

    fn unload_model(&mut self, name: &str) {
        if let Some(residency) = self.inner.residency() {
            residency.unload_model(name);
        }
    }

    fn share_model(&mut self, name: &str, with: &str) -> Result<(), String> {
        // Nothing is allocated: the capacity check a load makes has nothing new to see.
        self.inner.loader(name)?.share_model(name, with)
    }

    fn release_memory(&mut self, probe: &dyn Fn(&str) -> Option<Vec<Tensor>>) {
        if let Some(residency) = self.inner.residency() {
            residency.release_memory(probe);
        }
    }
}
