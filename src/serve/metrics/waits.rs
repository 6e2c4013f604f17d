//! `vramguard_service_waits_total{service,reason}`: the requests a service's budgets held back
//! before they ran, and what each waited for.

use prometheus_client::encoding::EncodeLabelSet;

/// What a request held back by its service's budgets waits for, as the `reason` label of
/// `vramguard_service_waits_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum WaitFor {
    /// Its service is at its `concurrency`.
    concurrency,
    /// Its service would go over its `device_memory` until its own running requests finish.
    device_memory,
    /// A `background` service's request behind waiting interactive work or a device short of
    /// its reserve.
    background,
}

impl WaitFor {
    /// Every reason.
    pub const ALL: [WaitFor; 3] = [WaitFor::concurrency, WaitFor::device_memory, WaitFor::background];
}

/// `vramguard_service_waits_total{service,reason}`: requests their service's budgets held back
/// (each counted once, however long it waited).
#[derive(Debug, Clone, Default)]
pub struct ServiceWaits {
    family: prometheus_client::metrics::family::Family<WaitLabels, prometheus_client::metrics::counter::Counter>,
}

/// `{service, reason}` of a wait.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WaitLabels {
    /// The service.
    pub service: String,
    /// What it waited for.
    pub reason: WaitFor,
}

impl ServiceWaits {
    /// Register the family.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "service_waits",
            "Requests a service's budgets held back before they ran: concurrency, device_memory, or a background service giving way",
            self.family.clone(),
        );
    }

    /// Count one request of `service` held back for `reason`.
    pub fn waited(&self, service: &str, reason: WaitFor) {
        self.family
            .get_or_create(&WaitLabels {
                service: service.to_string(),
                reason,
            })
            .inc();
    }

    /// Create `service`'s series at 0.
    pub fn zero(&self, service: &str) {
        for reason in WaitFor::ALL {
            let _ = self.family.get_or_create(&WaitLabels {
                service: service.to_string(),
                reason,
            });
        }
    }
}
